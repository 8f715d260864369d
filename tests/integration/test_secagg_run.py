"""Federated runs with secure-aggregation=true (ServerApp loop and ClientApp in process):
the model moves by exactly the plaintext sum of the clients' quantized, noised inputs; a
client lost after key sharing or after its masked input costs the round nothing else; bytes,
both epsilons and the nodes' ledgers recorded."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Context, Message

import fedsparse.client.app as client_module
import fedsparse.client.secagg as client_secagg
import fedsparse.server.loop as loop_module
import fedsparse.server.secagg as server_secagg
from fedsparse.client.app import app as client_app
from fedsparse.client.ledger import PrivacyLedger
from fedsparse.client.node_policy import SIMULATION_NODE_POLICY
from fedsparse.client.state import NodeState
from fedsparse.common.aggregation.secure import (
    central_noise_multiplier,
    decode_sum,
    ring_sum,
    worst_case_noise_multiplier,
)
from fedsparse.common.aggregation.small_ring import rotation_seed
from fedsparse.common.config import FederatedConfig
from fedsparse.common.dp.accounting import compute_epsilon_of_history
from fedsparse.common.dp.central import calibrate_central_noise
from fedsparse.common.wire.secagg import COLLECT, STAGE, STAGES, UNMASK
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.round_stats import FederationFailed
from fedsparse.server.round_updates import round_support
from fedsparse.server.secagg_round import secure_round

NODES = 6
GRIDS: list[InProcessGrid] = []  # the last run's grid: its nodes' contexts


class Recorder:
    """What each party computed, per round: the clients' ring inputs, the server's decoded
    sum and ring, and the model before and after."""

    def __init__(self) -> None:
        self.inputs: dict[int, dict[int, torch.Tensor]] = {}  # round -> node -> ring input
        self.decoded: dict[int, tuple[torch.Tensor, Any, list[int]]] = {}
        self.models: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        self.nonces: dict[int, bytes] = {}  # round -> the server's nonce (a small ring's rotation)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    rec = Recorder()
    collect = client_secagg.SecAggClient.collect

    def collecting(self: Any, payload: dict[str, Any], values: torch.Tensor) -> dict[str, Any]:
        def encoding(*args: Any) -> torch.Tensor:
            out = client_secagg_encode(*args)
            rec.inputs.setdefault(payload["round_id"], {})[self.node_id] = out
            return out

        monkeypatch.setattr(client_secagg, "encode", encoding)
        try:
            return collect(self, payload, values)
        finally:
            monkeypatch.setattr(client_secagg, "encode", client_secagg_encode)

    decode = server_secagg.SecAggServer.decode

    def decoding(self: Any, ring_total: torch.Tensor) -> torch.Tensor:
        out = decode(self, ring_total)
        rec.decoded[self.round_id] = (out, self.params, self.survivors)
        rec.nonces[self.round_id] = self.nonce
        return out

    def round_(strategy: Any, grid: Any, server_round: int, messages: Any, **kw: Any) -> Any:
        before = strategy.round_model.clone()
        arrays = secure_round(strategy, grid, server_round, messages, **kw)
        after = torch.from_numpy(arrays["flat"].numpy().copy())
        rec.models[server_round] = (before, after, round_support(strategy.last_round, strategy.d))
        return arrays

    client_secagg_encode = client_secagg.encode
    monkeypatch.setattr(client_secagg.SecAggClient, "collect", collecting)
    monkeypatch.setattr(server_secagg.SecAggServer, "decode", decoding)
    monkeypatch.setattr(loop_module, "secure_round", round_)
    yield rec


def _run(out: Path, *, node_config: dict[str, Any] | None = None, **kwargs: Any) -> list[dict]:
    settings: dict[str, Any] = {
        "num_rounds": 2,
        "dp_level": "user",
        "clients_per_round": NODES,  # q = 1: every node, every round
        "central_noise_multiplier": 1.0,
        "central_clip": 0.5,
        "seed": 5,
        "secure_aggregation": True,
        "final_rate": 0.9,
        "schedule": "constant",
        "lr": 0.5,
    }
    cfg = FederatedConfig(out_dir=str(out), **{**settings, **kwargs})
    grid = InProcessGrid(
        client_app,
        num_nodes=NODES,
        run_config=cfg.to_run_config(),
        node_config={**SIMULATION_NODE_POLICY, **(node_config or {})},
    )
    loop_module.run_federated(grid, cfg)
    GRIDS[:] = [grid]
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


def _plaintext(rec: Recorder, server_round: int) -> torch.Tensor:
    noisy_sum, params, survivors = rec.decoded[server_round]
    inputs = rec.inputs[server_round]
    rotation = rotation_seed(server_round, rec.nonces[server_round])
    return decode_sum(ring_sum([inputs[n] for n in survivors], params.bits), params, rotation)


@pytest.mark.slow
def test_a_secure_run_moves_the_model_by_the_plaintext_sum_of_the_same_inputs(
    tmp_path: Path, recorder: Recorder
) -> None:
    rounds = _run(tmp_path / "run")
    assert [r["num_accepted"] for r in rounds] == [NODES, NODES]
    assert {r["noise"] for r in rounds} == {"seeded"}  # the simulation's nodes say so
    for r in rounds:
        noisy_sum, params, survivors = recorder.decoded[r["round"]]
        assert len(survivors) == NODES and params.threshold == NODES // 2 + 1
        plain = _plaintext(recorder, r["round"])
        assert torch.equal(noisy_sum, plain)  # the masks cancel exactly
        before, after, support = recorder.models[r["round"]]
        expected = before.clone()
        assert support is not None and support.numel() == params.kept
        expected[support] += plain.to(torch.float32) / NODES  # w + sum / (q N)
        assert torch.equal(after, expected)
        # bytes: every stage counted both ways; the uplink is those stages' replies
        assert set(r["secagg_bytes"]) == set(STAGES)
        assert r["uplink_payload_bytes"] == sum(s["up"] for s in r["secagg_bytes"].values())
        masked = r["secagg_bytes"]["collect_masked_vectors"]["up"]
        assert masked >= NODES * params.input_bytes
    # both epsilons: central at rate 1 over the rounds, each node's worst case (its share)
    sigma = central_noise_multiplier(params, NODES)
    central = compute_epsilon_of_history([(sigma, 1.0, 2)], delta=1e-5, accountant="rdp")
    assert rounds[-1]["central_epsilon"] == pytest.approx(central, rel=1e-9)
    assert [r["central_noise_multiplier"] for r in rounds] == [sigma, sigma]  # the survivors'
    assert rounds[-1]["user_epsilon"] == pytest.approx(central, rel=1e-9)  # q = 1
    worst = worst_case_noise_multiplier(params) / 2  # one example moves the update by 2C
    node = compute_epsilon_of_history([(worst, 1.0, 2)], delta=1e-5, accountant="rdp")
    assert rounds[-1]["epsilon_max"] == pytest.approx(node, rel=1e-9)
    assert rounds[-1]["epsilon_max"] > rounds[-1]["central_epsilon"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["central_epsilon"] == rounds[-1]["central_epsilon"]
    # Every node holds the server's model of round 1 bit for bit, patched from a values-only
    # downlink on round 1's seeded mask (no dense model a round).
    after_first = recorder.models[1][1]
    for context in GRIDS[0]._contexts.values():
        assert torch.equal(NodeState.load(context, after_first.numel()).model, after_first)
    assert rounds[1]["downlink_payload_bytes"] < rounds[0]["downlink_payload_bytes"] / 4


def _failing(node: int, stage: str) -> Any:
    answer = client_module.answer

    def failing(msg: Message, context: Context) -> Message:
        payload = msg.content.config_records["fedsparse.secagg"]
        if context.node_id == node and payload.get(STAGE) == stage:
            raise RuntimeError(f"node {node} lost at {stage}")
        return answer(msg, context)

    return failing


@pytest.mark.slow
@pytest.mark.parametrize("stage", [COLLECT, UNMASK])
def test_a_node_lost_between_stages_leaves_the_survivors_sum_exact(
    tmp_path: Path, recorder: Recorder, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """Lost before its masked input (its pairwise masks come off through its sk1 shares) or
    after it (its self mask comes off through its seed shares: its input stays in)."""
    lost = 1003
    monkeypatch.setattr(client_module, "answer", _failing(lost, stage))
    rounds = _run(tmp_path / "run", num_rounds=1)
    noisy_sum, _, survivors = recorder.decoded[1]
    assert (lost in survivors) == (stage == UNMASK)
    assert len(survivors) == (NODES if stage == UNMASK else NODES - 1)
    assert torch.equal(noisy_sum, _plaintext(recorder, 1))
    assert not rounds[0]["failed"]
    assert any(f"node {lost}" in reason for reason in rounds[0]["rejected"])


@pytest.mark.slow
def test_too_few_survivors_fail_the_round_and_leave_the_model(
    tmp_path: Path, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    answer = client_module.answer

    def most_lost(msg: Message, context: Context) -> Message:
        if context.node_id % 2 == 0:  # half the nodes: below the threshold n/2 + 1
            raise RuntimeError("lost")
        return answer(msg, context)

    monkeypatch.setattr(client_module, "answer", most_lost)
    with pytest.raises(FederationFailed, match="the run trained nothing"):
        _run(tmp_path / "run", num_rounds=1, max_failed_rounds=0)
    lines = (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()
    rounds = [json.loads(line) for line in lines]  # recorded all the same
    assert rounds[0]["failed"] and "threshold" in rounds[0]["failure"]
    before, after, _ = recorder.models[1]
    assert torch.equal(before, after) and 1 not in recorder.decoded
    assert rounds[0]["user_epsilon"] is None  # nothing released, nothing accounted


@pytest.mark.slow
def test_each_node_ledger_charges_its_worst_case(tmp_path: Path, recorder: Recorder) -> None:
    ledgers = tmp_path / "ledgers"
    _run(tmp_path / "run", num_rounds=2, node_config={"ledger-dir": str(ledgers)})
    files = sorted(p for p in ledgers.glob("data-*.json") if p.name.count(".") == 1)
    assert len(files) == NODES  # one per node's data
    for path in files:  # and the rounds it released a masked input for, under its lock
        released = json.loads(path.with_suffix(".released.json").read_text())
        assert released == [[1, 1], [1, 2]]
        answered = json.loads(path.with_suffix(".answered.json").read_text())
        every = ",".join(str(1001 + i) for i in range(NODES))  # the survivor set it unmasked
        # by round and the server's nonce, across runs: the ring it shared its secrets in
        # (its digest), the set it unmasked; no consistency stage (no identity)
        scopes = [key.split("/") for key in sorted(answered)]
        stages = [(r, stage) for r, _, stage in scopes]
        assert stages == [("1", "share_keys"), ("1", UNMASK), ("2", "share_keys"), ("2", UNMASK)]
        assert all(len(bytes.fromhex(nonce)) >= 16 for _, nonce, _ in scopes)
        by_stage = {
            stage: [v for k, v in answered.items() if k.endswith(stage)]
            for stage in ("share_keys", UNMASK)
        }
        assert by_stage[UNMASK] == [every, every]
        assert [len(bytes.fromhex(v)) for v in by_stage["share_keys"]] == [32, 32]
    _, params, _ = recorder.decoded[2]
    worst = worst_case_noise_multiplier(params)
    for path in files:
        ledger = PrivacyLedger(path)
        entries = ledger.entries()
        assert [(e.mechanism, e.server_round) for e in entries] == [("secagg", 1), ("secagg", 2)]
        assert all(e.noise_multiplier == pytest.approx(worst) for e in entries)
        expected = compute_epsilon_of_history([(worst / 2, 1.0, 2)], delta=1e-5, accountant="rdp")
        assert ledger.epsilon(1e-5) == pytest.approx(expected, rel=1e-9)
        assert math.isfinite(ledger.epsilon(1e-5))


@pytest.mark.slow
def test_a_node_whose_values_overflow_sends_zeros_not_an_error(
    tmp_path: Path, recorder: Recorder
) -> None:
    """A server that picks the model and the lr can overflow a weight on one example alone;
    an error reply would then tell it that example is in the node's data. Under secure
    aggregation a node never fails on its own values: a non-finite vector travels as zeros."""
    rounds = _run(tmp_path / "run", num_rounds=1, lr=3.4e38)
    assert rounds[0]["rejected"] == [] and not rounds[0]["failed"]
    noisy_sum, params, survivors = recorder.decoded[1]
    assert len(survivors) == NODES
    # every input was zeros plus noise: the sum is the noise alone, of the survivors' shares
    share = params.share_std / params.scale
    assert float(noisy_sum.std()) == pytest.approx(share * NODES**0.5, rel=0.1)


@pytest.mark.slow
def test_a_second_collect_on_a_copy_of_the_state_is_refused(
    tmp_path: Path, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two copies of a collect message handled at once read the same Context.state; the
    release marker beside the node's ledger, under its lock, refuses the second."""
    import copy

    from fedsparse.client.node_policy import PrivacyRefusal

    answer = client_module.answer
    outcomes: list[str] = []

    def twice(msg: Message, context: Context) -> Message:
        payload = msg.content.config_records["fedsparse.secagg"]
        if context.node_id != 1001 or payload.get(STAGE) != COLLECT:
            return answer(msg, context)
        snapshot = copy.deepcopy(context)
        reply = answer(msg, context)
        try:
            answer(msg, snapshot)
            outcomes.append("released twice")
        except PrivacyRefusal as err:
            outcomes.append(str(err))
        return reply

    monkeypatch.setattr(client_module, "answer", twice)
    _run(tmp_path / "run", num_rounds=1, node_config={"ledger-dir": str(tmp_path / "l")})
    assert outcomes == ["round=1: this node already released its masked input for round 1 of run 1"]
    assert recorder.decoded[1][2] == list(range(1001, 1001 + NODES))


def _solved(target: float, rounds: int) -> float:
    """The sigma ``calibrate_central_noise`` picks for the run in round 1 (q = 1)."""
    return calibrate_central_noise(
        target_epsilon=target, sample_rate=1.0, rounds=rounds, delta=1e-5
    )


@pytest.mark.slow
def test_a_central_target_is_met_for_the_fewest_survivors_and_hit_at_the_threshold(
    tmp_path: Path, recorder: Recorder
) -> None:
    """central-target-epsilon under secure aggregation: each round's ring gives its threshold
    of survivors the sigma solved for the run, and the round is accounted at that sigma; with
    c = 4 of 6 the threshold is every node."""
    target = 8.0
    rounds = _run(tmp_path / "run", num_rounds=3, central_target_epsilon=target, secagg_colluders=4)
    solved = _solved(target, 3)
    assert [r["num_accepted"] for r in rounds] == [NODES] * 3
    for r in rounds:
        _, params, survivors = recorder.decoded[r["round"]]
        assert params.threshold == NODES and len(survivors) == NODES
        assert solved <= central_noise_multiplier(params, NODES) <= solved * (1 + 1e-12)
        assert r["central_noise_multiplier"] == solved
    assert target * (1 - 1e-3) <= rounds[-1]["user_epsilon"] <= target
    # each node's own worst case, beside it: its share alone, at sample level
    worst = [worst_case_noise_multiplier(recorder.decoded[r][1]) / 2 for r in (1, 2, 3)]
    node = compute_epsilon_of_history([(w, 1.0, 1) for w in worst], delta=1e-5, accountant="rdp")
    assert rounds[-1]["epsilon_max"] == pytest.approx(node, rel=1e-9)


@pytest.mark.slow
def test_a_central_target_holds_at_the_floor_whoever_drops_out(
    tmp_path: Path, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With t = 4 of 6 a round's survivors carry sqrt((m - c)/(t - c)) times the sigma solved
    for the run; each round is accounted at that floor, so how many survived (a node lost at
    the collect stage in round 2) never moves a later round's sigma, and the run spends the
    target."""
    monkeypatch.setattr(client_module, "answer", _failing_in_round(1002, COLLECT, 2))
    target = 8.0
    rounds = _run(tmp_path / "run", num_rounds=3, central_target_epsilon=target)
    solved = _solved(target, 3)
    assert [len(recorder.decoded[r][2]) for r in (1, 2, 3)] == [NODES, NODES - 1, NODES]
    for r in rounds:
        _, params, survivors = recorder.decoded[r["round"]]
        fewest = central_noise_multiplier(params, params.threshold)
        assert params.threshold == 4 and solved <= fewest <= solved * (1 + 1e-12)
        realized = central_noise_multiplier(params, len(survivors))
        assert realized == pytest.approx(fewest * math.sqrt(len(survivors) / 4), rel=1e-12)
        assert r["central_noise_multiplier"] == solved < realized
    assert target * (1 - 1e-3) <= rounds[-1]["user_epsilon"] <= target


@pytest.mark.slow
def test_under_a_central_target_a_node_still_refuses_a_worst_case_below_its_floor(
    tmp_path: Path, recorder: Recorder
) -> None:
    """The server's calibrated sigma is its word; a node's floor on its own share holds."""
    with pytest.raises(FederationFailed):
        _run(
            tmp_path / "run",
            num_rounds=1,
            max_failed_rounds=0,
            central_target_epsilon=8.0,
            node_config={"min-noise-multiplier": 5.0},
        )
    lines = (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert first["failed"] and first["num_accepted"] == 0
    assert all("noise multiplier" in reason for reason in first["rejected"]), first["rejected"]
    assert 1 not in recorder.decoded


def _failing_in_round(node: int, stage: str, server_round: int) -> Any:
    answer = client_module.answer

    def failing(msg: Message, context: Context) -> Message:
        payload = msg.content.config_records["fedsparse.secagg"]
        lost = context.node_id == node and payload.get(STAGE) == stage
        if lost and payload.get("round_id") == server_round:
            raise RuntimeError(f"node {node} lost at {stage} in round {server_round}")
        return answer(msg, context)

    return failing


@pytest.mark.slow
def test_a_node_policys_identity_and_roster_sign_and_check_the_ring(
    tmp_path: Path, recorder: Recorder
) -> None:
    """Through the ClientApp: every simulated node signs with the policy's one identity, so
    its five peers carry one roster identity, one party: a node requiring none takes the ring
    (the signatures travel), a node requiring one counts the four other names of that party
    off its roster, more than the colluders it tolerates, and refuses it."""
    from fedsparse.client.secagg_identity import write_identity

    key, roster = tmp_path / "identity.pem", tmp_path / "roster.txt"
    roster.write_text(write_identity(key) + "\n")
    policy = {"secagg-identity": str(key), "secagg-roster": str(roster)}
    signed = _run(tmp_path / "one", num_rounds=1, node_config={**policy, "secagg-min-trusted": 0})
    plain = _run(tmp_path / "plain", num_rounds=1)
    assert signed[0]["num_accepted"] == NODES and not signed[0]["failed"]
    extra = signed[0]["secagg_bytes"]["setup"]["up"] - plain[0]["secagg_bytes"]["setup"]["up"]
    assert extra == NODES * (len("identity") + 32 + len("signature") + 64 + len("enforces") + 8)
    # through the ClientApp each node signs the ring it was shown too (its identity loaded
    # at the share-keys stage: a reviewer found it was not)
    up = (
        signed[0]["secagg_bytes"]["share_keys"]["up"] - plain[0]["secagg_bytes"]["share_keys"]["up"]
    )
    assert up == NODES * (len("ring_signature") + 64)
    with pytest.raises(FederationFailed):
        _run(
            tmp_path / "two",
            num_rounds=1,
            max_failed_rounds=0,
            node_config={**policy, "secagg-min-trusted": 1, "ledger-dir": str(tmp_path / "l")},
        )
    first = json.loads((tmp_path / "two" / "rounds.jsonl").read_text().splitlines()[0])
    assert first["failed"] and first["num_accepted"] == 0
    outside = "4 of the ring's 5 other members are off this node's roster or enforce nothing, "
    outside += "more than the 0"
    assert sum(outside in r for r in first["rejected"]) == NODES


@pytest.mark.slow
def test_a_second_survivor_set_or_unmask_on_a_copy_of_the_state_is_refused(
    tmp_path: Path, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reviewers' races: two copies of a share-keys message (another ring on the second: the
    node's sk1 would be shared in both), of a consistency message (another survivor set) or
    of an unmask message, handled at once, read the same Context.state; the ledger's file,
    under its lock, lets the node share in one ring, sign one set and unmask once."""
    import copy

    from fedsparse.client.node_policy import PrivacyRefusal
    from fedsparse.client.secagg_identity import write_identity

    answer = client_module.answer
    outcomes: dict[str, str] = {}

    def twice(msg: Message, context: Context) -> Message:
        payload = dict(msg.content.config_records["fedsparse.secagg"])
        stage = payload.get(STAGE)
        if context.node_id != 1001 or stage not in ("share_keys", "consistency", UNMASK):
            return answer(msg, context)
        snapshot = copy.deepcopy(context)
        reply = answer(msg, context)
        second = copy.deepcopy(msg)
        record = second.content.config_records["fedsparse.secagg"]
        if stage == "consistency":  # the set without node 1006: still above the threshold
            record["active_nids"] = [n for n in payload["active_nids"] if n != 1006]
        if stage == "share_keys":  # the ring without node 1006: another ring
            at = list(payload["nids"]).index(1006)
            for name in ("nids", "pk1", "pk2", "identities", "signatures", "enforcing"):
                record[name] = [v for i, v in enumerate(payload[name]) if i != at]
        try:
            answer(second, snapshot)
            outcomes[str(stage)] = "answered twice"
        except PrivacyRefusal as err:
            outcomes[str(stage)] = str(err)
        return reply

    monkeypatch.setattr(client_module, "answer", twice)
    key, roster = tmp_path / "identity.pem", tmp_path / "roster.txt"
    roster.write_text(write_identity(key) + "\n")
    policy = {"ledger-dir": str(tmp_path / "l"), "secagg-identity": str(key)}
    _run(tmp_path / "run", num_rounds=1, node_config=policy)
    assert outcomes == {
        stage: f"round=1: this node already answered stage {stage!r} of round 1 of run 1"
        for stage in ("share_keys", "consistency", UNMASK)
    }
    assert recorder.decoded[1][2] == list(range(1001, 1001 + NODES))


@pytest.mark.slow
def test_an_unmask_on_a_copy_from_before_the_signature_must_name_the_signed_set(
    tmp_path: Path, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reviewer's race: a node that requires no roster members (secagg-min-trusted 0) signs
    the survivor set; an unmask that declares one of those survivors dropped, handled on a
    copy of its state from before the signature (which checks no set), is refused by the
    ledger: the signature binds the node's unmask, as the nodes that count it rely on."""
    import copy

    from fedsparse.client.node_policy import PrivacyRefusal
    from fedsparse.client.secagg_identity import write_identity

    answer = client_module.answer
    refused: list[str] = []

    def split(msg: Message, context: Context) -> Message:
        payload = dict(msg.content.config_records["fedsparse.secagg"])
        if context.node_id != 1001 or payload.get(STAGE) != "consistency":
            return answer(msg, context)
        before = copy.deepcopy(context)  # after collect, before any survivor set
        reply = answer(msg, context)
        other = copy.deepcopy(msg)
        record = other.content.config_records["fedsparse.secagg"]
        record[STAGE] = UNMASK
        record["active_nids"] = [n for n in payload["active_nids"] if n != 1006]
        record["dead_nids"] = [1006]
        with pytest.raises(PrivacyRefusal) as err:
            answer(other, before)
        refused.append(str(err.value))
        return reply

    monkeypatch.setattr(client_module, "answer", split)
    key = tmp_path / "identity.pem"
    write_identity(key)
    policy = {"ledger-dir": str(tmp_path / "l"), "secagg-identity": str(key)}
    _run(tmp_path / "run", num_rounds=1, node_config=policy)
    assert refused == [
        "round=1: stage 'unmask' names another survivor set than the node's answer to stage "
        "'consistency' of round 1 of run 1"
    ]
    assert recorder.decoded[1][2] == list(range(1001, 1001 + NODES))  # the round went on


def test_the_ledger_binds_a_signed_survivor_set_and_the_unmask_either_way(
    tmp_path: Path,
) -> None:
    from fedsparse.client.node_policy import PrivacyRefusal

    for first, second in (("consistency", UNMASK), (UNMASK, "consistency")):
        ledger = PrivacyLedger(tmp_path / f"{first}.json")
        ledger.answer_once(1, 7, first, "1,2,3", binds=second)
        with pytest.raises(PrivacyRefusal, match="names another survivor set"):
            ledger.answer_once(1, 7, second, "1,2", binds=first)
        ledger.answer_once(1, 8, second, "1,2", binds=first)  # another round: its own
        ledger.answer_once(1, 7, second, "1,2,3", binds=first, again=False)
        with pytest.raises(PrivacyRefusal, match="already answered"):
            ledger.answer_once(1, 7, second, "1,2,3", binds=first, again=False)


def test_a_round_and_nonce_reused_in_another_run_get_no_second_survivor_set(
    tmp_path: Path,
) -> None:
    """A reviewer's replay: what a node signs names the round and the server's nonce, not the
    run, so a server reusing both in a second run must not get another set signed there."""
    from fedsparse.client.node_policy import PrivacyRefusal

    ledger, nonce = PrivacyLedger(tmp_path / "data.json"), bytes(range(16))
    ledger.answer_once(1, 4, "consistency", "1,2,3,4", nonce=nonce, binds=UNMASK)
    with pytest.raises(PrivacyRefusal, match="already answered stage 'consistency'"):
        ledger.answer_once(2, 4, "consistency", "1,2,3", nonce=nonce, binds=UNMASK)
    with pytest.raises(PrivacyRefusal, match="names another survivor set"):
        ledger.answer_once(2, 4, UNMASK, "1,2,3", nonce=nonce, binds="consistency", again=False)
    ledger.answer_once(2, 4, "consistency", "1,2,3", nonce=bytes(16), binds=UNMASK)  # fresh


@pytest.mark.slow
def test_nodes_with_keys_of_their_own_enforce_and_move_the_model_as_unsigned_nodes(
    tmp_path: Path, recorder: Recorder
) -> None:
    """Through the ClientApp, one policy for every node (``node-{partition-id}.pem``: a key
    each, all on the roster): nodes requiring all five peers trusted take the ring, sign it
    and the survivor set, unmask, and the model moves bit for bit as the same nodes' without
    identities (the signatures cost bytes, not one value)."""
    from fedsparse.client.secagg_identity import write_identities

    roster = write_identities(tmp_path / "keys", NODES)
    policy = {
        "secagg-identity": str(tmp_path / "keys" / "node-{partition-id}.pem"),
        "secagg-roster": str(roster),
        "secagg-min-trusted": NODES - 1,
        "ledger-dir": str(tmp_path / "ledgers"),
    }
    signed = _run(tmp_path / "signed", node_config=policy)
    models = {r: after.clone() for r, (_, after, _) in recorder.models.items()}
    plain = _run(tmp_path / "plain")
    assert [r["num_accepted"] for r in signed] == [NODES, NODES]
    assert not any(r["failed"] for r in signed) and not any(r["rejected"] for r in signed)
    assert sorted(models) == [1, 2]
    for server_round, (_, after, _) in recorder.models.items():
        assert torch.equal(models[server_round], after)
    for s, p in zip(signed, plain, strict=True):
        assert s["epsilon_max"] == p["epsilon_max"]
        grown = {
            stage: s["secagg_bytes"][stage]["up"] - p["secagg_bytes"].get(stage, {"up": 0})["up"]
            for stage in s["secagg_bytes"]
        }
        # a key a node: the advertisement's identity, flag and signature; its ring signed
        assert grown["setup"] == NODES * (
            len("identity") + 32 + len("signature") + 64 + len("enforces") + 8
        )
        assert grown["share_keys"] == NODES * (len("ring_signature") + 64)
        assert all(extra >= 0 for extra in grown.values()), grown
        # each survivor signed the survivor set; the unmask relays those signatures
        assert "consistency" not in p["secagg_bytes"] and grown["consistency"] > 0
        assert s["secagg_bytes"]["unmask"]["down"] > p["secagg_bytes"]["unmask"]["down"]
    # the control: node 0's key off the roster, its five peers each count one untrusted member
    kept = roster.read_text().splitlines()[1:]
    (tmp_path / "short.txt").write_text("\n".join(kept) + "\n")
    with pytest.raises(FederationFailed):
        _run(
            tmp_path / "short",
            num_rounds=1,
            max_failed_rounds=0,
            node_config={
                **policy,
                "secagg-roster": str(tmp_path / "short.txt"),
                "ledger-dir": str(tmp_path / "other-ledgers"),  # (a run 1 again)
            },
        )
    first = json.loads((tmp_path / "short" / "rounds.jsonl").read_text().splitlines()[0])
    outside = "1 of the ring's 5 other members are off this node's roster or enforce nothing"
    assert first["failed"] and sum(outside in r for r in first["rejected"]) == NODES - 1


@pytest.mark.slow
def test_a_sparse_ring_moves_the_model_as_the_complete_graph_for_fewer_key_bytes(
    tmp_path: Path, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the ClientApp with ``secagg-neighbours = 2`` (each of 6 nodes masks with and
    shares among 2): the same ring inputs, so the model moves bit for bit as over the complete
    graph, and each key-sharing stage costs less both ways; a node lost before its masked
    input leaves the survivors' sum exact (its neighbours' shares rebuild its key)."""
    sparse = _run(tmp_path / "sparse", secagg_neighbours=2)
    models = {r: after.clone() for r, (_, after, _) in recorder.models.items()}
    assert all(recorder.decoded[r][1].neighbours == 2 for r in (1, 2))
    complete = _run(tmp_path / "complete")
    assert [r["num_accepted"] for r in sparse] == [NODES, NODES]
    for server_round, (_, after, _) in recorder.models.items():
        assert torch.equal(models[server_round], after)
    for s, c in zip(sparse, complete, strict=True):
        assert s["epsilon_max"] == c["epsilon_max"]
        assert s["central_epsilon"] == c["central_epsilon"]
        for direction in ("up", "down"):
            keys_s, keys_c = s["secagg_bytes"]["share_keys"], c["secagg_bytes"]["share_keys"]
            assert keys_s[direction] < keys_c[direction]
        assert (
            s["secagg_bytes"]["collect_masked_vectors"]["up"]
            == (c["secagg_bytes"]["collect_masked_vectors"]["up"])
        )
    lost = 1003
    monkeypatch.setattr(client_module, "answer", _failing(lost, COLLECT))
    rounds = _run(tmp_path / "lost", num_rounds=1, secagg_neighbours=2)
    noisy_sum, _, survivors = recorder.decoded[1]
    assert lost not in survivors and len(survivors) == NODES - 1
    assert torch.equal(noisy_sum, _plaintext(recorder, 1))
    assert not rounds[0]["failed"]


@pytest.mark.slow
def test_a_small_ring_moves_the_model_by_its_decoded_sum_at_12_bits_a_value(
    tmp_path: Path, recorder: Recorder
) -> None:
    """Through the ClientApp with ``secagg-ring-bits = 12``: every node's update accepted, the
    model moved by the decoded sum (the masks cancel; rotated back), the masked vectors 12
    bits a value where the exact ring spends whole bytes, and the central epsilon the one of
    the small ring's noise multiplier (its rounding bound and the sum's divergence charged)."""
    small = _run(tmp_path / "small", secagg_ring_bits=12)
    assert [r["num_accepted"] for r in small] == [NODES, NODES]
    for r in small:
        noisy_sum, params, survivors = recorder.decoded[r["round"]]
        assert params.modular and params.bits == 12 and len(survivors) == NODES
        plain = _plaintext(recorder, r["round"])
        assert torch.equal(noisy_sum, plain)
        before, after, support = recorder.models[r["round"]]
        expected = before.clone()
        assert support is not None
        expected[support] += plain.to(torch.float32) / NODES
        assert torch.equal(after, expected)
    sigma = central_noise_multiplier(params, NODES)
    central = compute_epsilon_of_history([(sigma, 1.0, 2)], delta=1e-5, accountant="rdp")
    assert small[-1]["central_epsilon"] == pytest.approx(central, rel=1e-9)
    assert [r["central_noise_multiplier"] for r in small] == [sigma, sigma]
    exact_rounds = _run(tmp_path / "exact")
    exact = recorder.decoded[2][1]
    assert not exact.modular and exact.bits > 12
    masked = [
        r["secagg_bytes"]["collect_masked_vectors"]["up"] for r in (small[1], exact_rounds[1])
    ]
    assert masked[1] - masked[0] == NODES * (exact.input_bytes - params.input_bytes)
    assert params.input_bytes == math.ceil(params.kept * 12 / 8)
