"""Secure aggregation end to end, server and clients as plain state machines: the exact sum,
dropouts between stages, what the server sees, too few survivors, malformed payloads, bytes,
bad shares named, noise nobody can predict, and a split view with a colluder."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from scipy import stats

import fedsparse.client.secagg as client_secagg
from fedsparse.client.secagg import SecAggClient, seeded_generators
from fedsparse.common.aggregation.secure import (
    PAIR_LABEL,
    SELF_LABEL,
    RingParams,
    choose_ring,
    discrete_gaussian,
    encode,
    expand_mask,
    pack_ring,
    pairwise_sign,
    ring_sum,
    unpack_ring,
)
from fedsparse.common.wire.secagg import RING_FIELDS, SecAggError, payload_bytes
from fedsparse.server.secagg import SecAggDropoutError, SecAggServer

IDS = [101, 202, 303, 404, 505]
K = 1000
ROUND = 4

RING_INPUTS: list[torch.Tensor] = []


@pytest.fixture(autouse=True)
def record_ring_inputs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each client's ring input as it computed it (values, rounding, noise): what the test
    compares the unmasked sum with. Nobody else can compute it: the noise is fresh."""

    def recording(*args: Any) -> torch.Tensor:
        out = encode(*args)
        RING_INPUTS.append(out)
        return out

    monkeypatch.setattr(client_secagg, "encode", recording)
    RING_INPUTS.clear()
    yield
    RING_INPUTS.clear()


def params(sigma: float = 1.0) -> RingParams:
    return choose_ring(clip=1.0, sigma=sigma, clients=5, threshold=3, kept=K)


def values(nid: int) -> torch.Tensor:
    v = torch.randn(K, generator=torch.Generator().manual_seed(nid), dtype=torch.float64)
    return v * (0.9 / float(v.norm()))


class Round:
    """A server and five clients; ``drop_*`` name the nodes that stop answering there."""

    def __init__(self, p: RingParams, inputs: dict | None = None, **policy: Any) -> None:
        """``policy``: the clients' own; ``seeded=True``: simulation noise seeded by node id."""
        self.p = p
        self.server = SecAggServer(p, IDS, round_id=ROUND)
        policy.setdefault("min_noise_multiplier", 0.5)
        seeded = policy.pop("seeded", False)
        sim = {nid: {"noise": "seeded", "noise_seed": nid} if seeded else {} for nid in IDS}
        self.clients = {nid: SecAggClient(nid, p, **policy, **sim[nid]) for nid in IDS}
        self.inputs = inputs or {nid: values(nid) for nid in IDS}
        self.masked: dict[int, dict[str, Any]] = {}
        self.ring_inputs: dict[int, torch.Tensor] = {}

    def keys(self, drop: Collection[int] = ()) -> None:
        s = self.server
        s.receive_setup({n: self.clients[n].handle(m) for n, m in s.setup_messages().items()})
        msgs = s.share_keys_messages()
        s.receive_share_keys(
            {n: self.clients[n].handle(m) for n, m in msgs.items() if n not in drop}
        )

    def collect(self, drop: Collection[int] = ()) -> None:
        self.server.receive_collect(self.replies(drop))

    def replies(
        self, drop: Collection[int] = (), msgs: dict[int, dict[str, Any]] | None = None
    ) -> dict[int, dict[str, Any]]:
        """The masked inputs, kept with the ring inputs they hide."""
        for n, m in (msgs or self.server.collect_messages()).items():
            if n not in drop:
                self.masked[n] = self.clients[n].handle(m, self.inputs[n])
                self.ring_inputs[n] = RING_INPUTS.pop()
        return dict(self.masked)

    def unmask(self, drop: Collection[int] = ()) -> torch.Tensor:
        msgs = self.server.unmask_messages()
        return self.server.receive_unmask(
            {n: self.clients[n].handle(m) for n, m in msgs.items() if n not in drop}
        )

    def expected(self, nodes: Collection[int]) -> torch.Tensor:
        """The plain sum of the nodes' quantized, noised ring inputs."""
        return ring_sum([self.ring_inputs[n] for n in sorted(nodes)], self.p.bits)


@pytest.mark.parametrize("sigma", [0.5, 1.0])
def test_the_unmasked_sum_is_the_sum_of_the_quantized_inputs(sigma: float) -> None:
    r = Round(params(sigma), min_noise_multiplier=0.2)
    r.keys()
    r.collect()
    total = r.unmask()
    assert torch.equal(total, r.expected(IDS))
    assert r.server.survivors == IDS
    decoded = r.server.decode(total)
    truth = sum(r.inputs.values())
    assert isinstance(truth, torch.Tensor)
    tolerance = 6 * (r.p.share_std * 5**0.5 + 5**0.5) / r.p.scale
    assert float((decoded - truth).abs().max()) < tolerance
    assert float((decoded - truth).abs().max()) > 0  # rounded (and noised): not the floats


def test_dropouts_after_key_sharing_and_after_masking_leave_the_survivors_sum_exact() -> None:
    r = Round(params())
    r.keys()
    r.collect(drop={202})  # shared its keys, never sent its vector: its pair masks come off
    assert r.server.survivors == [101, 303, 404, 505]
    unmask = r.server.unmask_messages()
    assert all(m["dead_nids"] == [202] for m in unmask.values())
    assert all(not set(m["active_nids"]) & set(m["dead_nids"]) for m in unmask.values())
    total = r.server.receive_unmask(
        {n: r.clients[n].handle(m) for n, m in unmask.items() if n != 404}
    )  # 404 sent its vector, then went silent: its seed is rebuilt from the others' shares
    assert torch.equal(total, r.expected([101, 303, 404, 505]))


def test_a_dropout_before_key_sharing_is_left_out_of_every_mask() -> None:
    r = Round(params())
    r.keys(drop={505})
    assert all(505 not in m["srcs"] for m in r.server.collect_messages().values())
    r.collect()
    assert all(m["dead_nids"] == [] for m in r.server.unmask_messages().values())
    assert torch.equal(r.unmask(), r.expected([101, 202, 303, 404]))


def _uniform_pvalues(data: bytes, p: RingParams) -> tuple[float, float]:
    v = unpack_ring(data, p.kept, p.bits).numpy().astype(np.float64)
    top = (v // 2 ** (p.bits - 4)).astype(np.int64)  # the ring's top 4 bits: 16 bins
    chi = stats.chisquare(np.bincount(top, minlength=16)).pvalue
    ks = stats.kstest(v / p.modulus, "uniform").pvalue
    return float(chi), float(ks)


def test_each_masked_vector_looks_uniform_to_the_server() -> None:
    p = params()
    # the most structured input there is: every client sends the same tiny vector
    same = torch.zeros(K, dtype=torch.float64)
    same[:10] = 0.01
    r = Round(p, {nid: same for nid in IDS})
    r.keys()
    r.collect()
    # the keys and self-mask seeds come from OS entropy: 10 p-values per run, each failing
    # with probability 1e-6 when the vectors are uniform
    for reply in r.masked.values():
        chi, ks = _uniform_pvalues(reply["masked_params"], p)
        assert chi > 1e-6 and ks > 1e-6
    # the control: the same vector unmasked is nowhere near uniform
    plain = r.ring_inputs[101]
    chi, ks = _uniform_pvalues(pack_ring(plain, p.bits), p)
    assert chi < 1e-10 and ks < 1e-10
    assert torch.equal(r.unmask(), r.expected(IDS))


def test_fewer_survivors_than_the_threshold_is_a_clear_error() -> None:
    r = Round(params())
    r.keys()
    with pytest.raises(SecAggDropoutError, match="2 of 5 nodes remain, fewer than the threshold 3"):
        r.collect(drop={101, 202, 303})
    r = Round(params())
    r.keys()
    r.collect(drop={101})
    with pytest.raises(SecAggDropoutError, match="stage 'unmask'.*fewer than the threshold 3"):
        r.unmask(drop={202, 303})
    r = Round(params())
    s = r.server
    s.setup_messages()
    with pytest.raises(SecAggDropoutError, match="stage 'setup'"):
        s.receive_setup({101: r.clients[101].handle(s.setup_messages()[101])})


def test_a_malformed_masked_vector_is_named() -> None:
    r = Round(params())
    r.keys()
    replies = r.replies()
    short = dict(replies)
    short[303] = {**replies[303], "masked_params": replies[303]["masked_params"][:-1]}
    with pytest.raises(SecAggError, match="'masked_params' of node 303: expected 3000 bytes"):
        r.server.receive_collect(short)
    wrong = dict(replies)
    wrong[303] = {**replies[303], "masked_params": [1, 2, 3]}
    with pytest.raises(
        SecAggError, match="field 'masked_params' must be bytes, got a list of int"
    ) as err:
        r.server.receive_collect(wrong)
    assert err.value.node == 303
    # nothing changed: the stage runs again without the broken reply, 303 now a dropout
    r.server.receive_collect({n: reply for n, reply in replies.items() if n != 303})
    total = r.server.receive_unmask(
        {n: r.clients[n].handle(m) for n, m in r.server.unmask_messages().items()}
    )
    assert torch.equal(total, r.expected([101, 202, 404, 505]))
    up = r.server.bytes["collect_masked_vectors"]["up"]
    assert up == 4 * (r.p.input_bytes + BINDING_BYTES)  # accepted replies only


@pytest.mark.parametrize(
    ("stage", "change", "message"),
    [
        ("share_keys", {"dsts": ["x"]}, "field 'dsts' must be list of int, got a list of str"),
        ("share_keys", {"ctxts": []}, "field 'ctxts' must pair with 'dsts'"),
        ("share_keys", {"dsts": None}, "field 'dsts' must be list of int, got NoneType"),
        ("setup", {"pk1": True}, "field 'pk1' must be bytes, got bool"),
        ("setup", {"extra": 1}, "unexpected field 'extra'"),
    ],
)
def test_a_malformed_reply_is_named(stage: str, change: dict[str, Any], message: str) -> None:
    r = Round(params())
    s = r.server
    replies = {n: r.clients[n].handle(m) for n, m in s.setup_messages().items()}
    if stage == "share_keys":
        s.receive_setup(replies)
        replies = {n: r.clients[n].handle(m) for n, m in s.share_keys_messages().items()}
    replies[404] = {**replies[404], **change}
    receive = s.receive_setup if stage == "setup" else s.receive_share_keys
    with pytest.raises(SecAggError, match=message):
        receive(replies)


def test_the_server_refuses_replies_from_strangers_and_stages_out_of_order() -> None:
    r = Round(params())
    with pytest.raises(SecAggError, match="'share_keys' out of order"):
        r.server.share_keys_messages()
    replies = {n: r.clients[n].handle(m) for n, m in r.server.setup_messages().items()}
    replies[999] = replies[101]
    with pytest.raises(SecAggError, match="node 999, which was not asked"):
        r.server.receive_setup(replies)


#: Per reply of the collection beyond the vector: its key's name, the round id and the nonce.
BINDING_BYTES = len("masked_params") + len("round_id") + 8 + len("nonce") + 16


def counted(*payloads: dict[int, dict[str, Any]]) -> list[int]:
    return [sum(payload_bytes(p) for p in by_node.values()) for by_node in payloads]


def test_every_stage_message_is_counted_up_and_down() -> None:
    p = params()
    r = Round(p)
    sent: dict[str, list[int]] = {}
    s = r.server
    msgs = s.setup_messages()
    replies = {n: r.clients[n].handle(m) for n, m in msgs.items()}
    s.receive_setup(replies)
    sent["setup"] = counted(msgs, replies)
    msgs = s.share_keys_messages()
    replies = {n: r.clients[n].handle(m) for n, m in msgs.items()}
    s.receive_share_keys(replies)
    sent["share_keys"] = counted(msgs, replies)
    msgs = s.collect_messages()
    replies = r.replies(msgs=msgs)
    s.receive_collect(replies)
    sent["collect_masked_vectors"] = counted(msgs, replies)
    msgs = s.unmask_messages()
    replies = {n: r.clients[n].handle(m) for n, m in msgs.items()}
    s.receive_unmask(replies)
    sent["unmask"] = counted(msgs, replies)
    assert s.bytes == {stage: {"down": d, "up": u} for stage, (d, u) in sent.items()}
    # the masked vectors: k elements of ceil(b/8) bytes each, per client, plus the key's name
    masked = 5 * (p.input_bytes + BINDING_BYTES)
    assert s.bytes["collect_masked_vectors"]["up"] == masked
    # the setup: 8 ring fields of 8 bytes, their names, the stage and the round's id and
    # 16-byte nonce, to each of 5 clients
    names = sum(len(f) for f in RING_FIELDS)
    binding = len("round_id") + 8 + len("nonce") + 16
    assert s.bytes["setup"]["down"] == 5 * (8 * 8 + names + len("stage") + len("setup") + binding)
    assert all(v > 0 for stage in s.bytes.values() for v in stage.values())


def test_payload_bytes_counts_as_a_config_record_does() -> None:
    from flwr.app import ConfigRecord

    payload = {"a": 1, "bb": 2.5, "c": b"xyz", "d": [1, 2, 3], "e": [b"ab", b"c"], "f": True}
    assert payload_bytes(payload) == ConfigRecord(payload).count_bytes()  # type: ignore[arg-type]


def test_what_colluding_peers_recover_still_carries_the_nodes_noise_share() -> None:
    """The worst case: every other node colludes with the server (or is the server's, under
    unauthenticated keys). What comes out is the node's input with its own noise share."""
    p = params(sigma=1.0)
    r = Round(p)
    r.keys()
    r.collect()
    total = r.unmask()
    others = r.expected([n for n in IDS if n != 303])  # each colluder knows its own input
    recovered = (total - others) & (p.modulus - 1)
    assert torch.equal(recovered, r.ring_inputs[303])
    error = r.server.decode(recovered) - r.inputs[303]
    assert float(error.std()) == pytest.approx(p.share_std / p.scale, rel=0.1)


def test_the_self_mask_hides_a_survivor_whose_pair_keys_are_known() -> None:
    """A server that learned 303's sk1 (all its pair masks) but not its self seed still sees
    a uniform vector; with the self seed too it sees 303's ring input."""
    p = params()
    r = Round(p)
    r.keys()
    r.collect()
    y = unpack_ring(r.masked[303]["masked_params"], p.kept, p.bits)
    for other, seed in r.clients[303].progress.pair_seed_of.items():
        y = (y - pairwise_sign(303, other) * expand_mask(seed, p.kept, p.bits, PAIR_LABEL)) & (
            p.modulus - 1
        )
    chi, ks = _uniform_pvalues(pack_ring(y, p.bits), p)
    assert chi > 1e-6 and ks > 1e-6
    plain = (y - expand_mask(r.clients[303].progress.self_seed, p.kept, p.bits, SELF_LABEL)) & (
        p.modulus - 1
    )
    assert torch.equal(plain, r.ring_inputs[303])
    chi, ks = _uniform_pvalues(pack_ring(plain, p.bits), p)
    assert chi < 1e-10 and ks < 1e-10


def _strip_seeded_noise(r: Round, total: torch.Tensor) -> torch.Tensor:
    """What a party that knows the node ids and the round does: regenerate each node's noise
    share as the seeded simulation draws it, and take it off the decoded sum."""
    noise = sum(
        discrete_gaussian(r.p.kept, r.p.share_std, seeded_generators(nid, ROUND)[1]) for nid in IDS
    )
    assert isinstance(noise, torch.Tensor)
    half = r.p.modulus >> 1
    lifted = torch.where(total >= half, total - r.p.modulus, total)
    return (lifted - noise).to(torch.float64) / r.p.scale


def test_fresh_noise_cannot_be_predicted_from_public_values() -> None:
    p = params()
    same = {nid: values(1) for nid in IDS}  # identical inputs everywhere
    rings = []
    for _ in range(2):  # the same round twice: same ids, round id, nonce and inputs
        r = Round(p, same)
        r.server.nonce = b"\x01" * 16
        r.keys()
        r.collect()
        rings.append(r.ring_inputs)
        assert r.server.seeded_noise == {nid: False for nid in IDS}
    for nid in IDS:
        assert not torch.equal(rings[0][nid], rings[1][nid])
        for other in IDS:
            if other != nid:
                assert not torch.equal(rings[0][nid], rings[0][other])
        replay = encode(same[nid], p, *seeded_generators(nid, ROUND))
        assert not torch.equal(rings[0][nid], replay)
    total = r.unmask()
    truth = sum(same.values())
    assert isinstance(truth, torch.Tensor)
    error = _strip_seeded_noise(r, total) - truth  # the replay attack removes nothing here
    assert float(error.std()) > 0.5 * 5**0.5 * p.share_std / p.scale


def test_seeded_noise_is_a_simulation_the_server_can_strip() -> None:
    """Only in the named simulation mode (``noise="seeded"``, here seeded by node id) can a
    party that knows the node ids and the round remove the noise from the sum."""
    p = params()
    r = Round(p, seeded=True)
    r.keys()
    assert r.server.seeded_noise == {nid: True for nid in IDS}
    r.collect()
    for nid in IDS:
        assert torch.equal(
            r.ring_inputs[nid], encode(r.inputs[nid], p, *seeded_generators(nid, ROUND))
        )
    truth = sum(r.inputs.values())
    assert isinstance(truth, torch.Tensor)
    stripped = _strip_seeded_noise(r, r.unmask())
    assert float((stripped - truth).abs().max()) <= 5 / p.scale  # rounding only: no DP left


def test_a_bad_unmask_share_is_named_and_the_stage_runs_again_without_it() -> None:
    r = Round(params())
    r.keys()
    r.collect(drop={202})  # 202's key is rebuilt from shares, the others' self seeds
    msgs = r.server.unmask_messages()
    replies = {n: r.clients[n].handle(m) for n, m in msgs.items()}
    replayed = {**replies[505], "shares": list(replies[404]["shares"])}  # a4: 404's shares
    seeds = list(replies[505]["shares"])
    seeds[0] = seeds[0][:4] + bytes(32) + seeds[0][36:]  # a5: a seed chunk, padding intact
    keys = list(replies[505]["shares"])
    k = replies[505]["nids"].index(202)
    keys[k] = keys[k][:4] + bytes(16) + keys[k][20:]  # 202's sk1 share
    for bad, what in [(replayed, "not sent to it"), (seeds, "self-mask seed"), (keys, "key")]:
        broken = {**replies, 505: bad if isinstance(bad, dict) else {**replies[505], "shares": bad}}
        with pytest.raises(SecAggError, match=f"node 505.*{what}|{what}.*node 505's") as err:
            r.server.receive_unmask(broken)
        assert err.value.node == 505
    # exactly t replies: a bad share is caught (not a silently wrong sum), its sender unknown
    few = {n: replies[n] for n in (101, 303)} | {505: {**replies[505], "shares": seeds}}
    with pytest.raises(SecAggError, match="no culprit found") as err:
        r.server.receive_unmask(few)
    assert err.value.node is None
    total = r.server.receive_unmask({n: reply for n, reply in replies.items() if n != 505})
    assert torch.equal(total, r.expected([101, 303, 404, 505]))


def test_a_masked_vector_must_name_its_round() -> None:
    r = Round(params())
    r.keys()
    replies = r.replies()
    for change in ({"round_id": ROUND + 1}, {"nonce": b"\x00" * 16}):
        with pytest.raises(SecAggError, match="'round_id'/'nonce' of node 303 is not this round"):
            r.server.receive_collect({**replies, 303: {**replies[303], **change}})
    with pytest.raises(SecAggError, match="unexpected field 'stage' in a reply"):
        r.server.receive_collect({**replies, 303: {**replies[303], "stage": "junk"}})
    r.server.receive_collect(replies)


def rebuilds(shares: list[bytes], secret: bytes) -> bool:
    try:
        return combine_shares(shares) == secret
    except ValueError:  # the padding does not check out: nothing rebuilt
        return False


def _split_view(
    r: Round, victim: int, colluder: int, alive: list[int], dead: list[int]
) -> tuple[list[bytes], list[bytes]]:
    """M1: the server tells ``alive`` the victim is alive (their answers hold its seed share)
    and ``dead`` that it dropped (its sk1 share); the colluder hands over both. Every story
    passes the clients' checks. The victim's seed shares and sk1 shares the server holds."""
    seed, sk1 = (
        [r.clients[colluder].progress.seed_shares[victim]],
        [r.clients[colluder].progress.sk1_shares[victim]],
    )
    bind = {"stage": "unmask", "round_id": ROUND, "nonce": r.server.nonce}
    for nodes, dead_nids, into in [(alive, [], seed), (dead, [victim], sk1)]:
        story = {
            **bind,
            "active_nids": [n for n in IDS if n not in dead_nids],
            "dead_nids": dead_nids,
        }
        for n in nodes:
            reply = r.clients[n].handle(dict(story))
            into.append(dict(zip(reply["nids"], reply["shares"], strict=True))[victim])
    return seed, sk1


def _unmask_one(r: Round, victim: int, seed: bytes, sk1: bytes) -> torch.Tensor:
    p = r.p
    y = unpack_ring(r.masked[victim]["masked_params"], p.kept, p.bits)
    y = y - expand_mask(seed, p.kept, p.bits, SELF_LABEL)
    for j in IDS:
        if j != victim:
            pair = client_secagg.pair_seed(sk1, r.server._pk[j][0])
            y = y - pairwise_sign(victim, j) * expand_mask(pair, p.kept, p.bits, PAIR_LABEL)
    return y & (p.modulus - 1)


def test_a_split_view_with_one_colluder_needs_a_collusion_aware_threshold() -> None:
    # n=5, t=3 (t > n/2 but 2t - n = 1, not above c = 1): one colluder is enough (a1)
    r = Round(params())
    r.keys()
    r.collect()
    seed, sk1 = _split_view(r, 303, 505, alive=[303, 101], dead=[202, 404])
    recovered = _unmask_one(r, 303, combine_shares(seed), combine_shares(sk1))
    assert torch.equal(recovered, r.ring_inputs[303])  # its input, with its own noise share
    # a node that allows for one colluder refuses that ring
    with pytest.raises(SecAggError, match="colluders is 0, this node requires at least 1"):
        SecAggClient(303, params(), min_noise_multiplier=0.5, colluders=1)
    # at t=4 with c=1, no split of the three honest nodes gives the server t shares of both
    p4 = choose_ring(clip=1.0, sigma=1.0, clients=5, threshold=4, kept=K, colluders=1)
    for size in range(4):
        for alive in itertools.combinations([101, 202, 404], size):
            r = Round(p4, min_noise_multiplier=0.4, colluders=1)
            r.keys()
            r.collect()
            dead = [n for n in (101, 202, 404) if n not in alive]
            seed, sk1 = _split_view(r, 303, 505, alive=[303, *alive], dead=dead)
            assert len(seed) < 4 or len(sk1) < 4
            victim = r.clients[303]
            assert not (
                rebuilds(seed, victim.progress.self_seed) and rebuilds(sk1, victim.progress.sk1)
            )


def _through_proto(client: SecAggClient) -> SecAggClient:
    """The client as a node keeps it between messages: ``Context.state``'s ConfigRecord,
    serialized as the SuperNode does."""
    from flwr.app import ConfigRecord
    from flwr.common.serde import config_record_from_proto, config_record_to_proto

    record = config_record_from_proto(config_record_to_proto(ConfigRecord(client.to_state())))
    return SecAggClient.from_state(dict(record))


def test_clients_saved_and_restored_between_every_stage_give_the_exact_sum() -> None:
    """Each stage runs on a client rebuilt from its saved state (as a Flower node between
    messages), with a dropout after key sharing: the sum is the survivors' exactly."""
    r = Round(params(), seeded=True)
    s = r.server

    def handled(msgs: dict[int, dict[str, Any]], drop: Collection[int] = ()) -> dict[int, Any]:
        out = {}
        for n, m in msgs.items():
            if n in drop:
                continue
            r.clients[n] = _through_proto(r.clients[n])
            if m.get("stage") == "collect_masked_vectors":
                out[n] = r.clients[n].handle(m, r.inputs[n])
                r.ring_inputs[n] = RING_INPUTS.pop()
            else:
                out[n] = r.clients[n].handle(m)
        return out

    s.receive_setup(handled(s.setup_messages()))
    s.receive_share_keys(handled(s.share_keys_messages()))
    s.receive_collect(handled(s.collect_messages(), drop=[IDS[1]]))
    total = s.receive_unmask(handled(s.unmask_messages()))
    assert torch.equal(total, r.expected([n for n in IDS if n != IDS[1]]))
    # what a node saved still refuses a second masked input for the round
    restored = _through_proto(r.clients[IDS[0]])
    assert restored.released_rounds == frozenset({ROUND})


def test_a_saved_state_that_is_not_one_is_a_clear_error() -> None:
    state = SecAggClient(IDS[0], params(), min_noise_multiplier=0.5).to_state()
    for broken in (
        {k: v for k, v in state.items() if k != "sk1"},
        {**state, "done": "nonsense"},
        {**state, "pair_seed_of.nids": [1, 2]},
        {**state, "ring.bits": 3},
    ):
        with pytest.raises(SecAggError, match="secure aggregation"):
            SecAggClient.from_state(broken)
