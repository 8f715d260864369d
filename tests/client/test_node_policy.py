"""The node's own policy and its persistent ledger (pure parts)."""

import json
import math
import multiprocessing
from pathlib import Path

import pytest

from fedsparse.client.ledger import PrivacyLedger, ledger_key, ledger_path
from fedsparse.client.node_policy import (
    NodePolicy,
    PrivacyRefusal,
    TrainingRequest,
    parse_assignments,
)
from fedsparse.common.dp.accounting import compute_epsilon


def request(server_round: int = 1, *, run_id: int = 1, sigma: float = 1.0, **kw) -> TrainingRequest:
    fields = dict(mechanism="dpsgd", sample_rate=0.01, steps=100, local_epochs=1)
    return TrainingRequest(
        run_id=run_id,
        server_round=server_round,
        noise_multiplier=sigma,
        **{**fields, **kw},
    )


def test_defaults_are_the_strict_ones() -> None:
    policy = NodePolicy()
    assert policy.noise == "fresh" and policy.allowed_mechanisms == ("dpsgd",)
    assert policy.epsilon_budget == 10.0 and policy.min_noise_multiplier == 0.5
    assert not policy.release_train_loss and not policy.release_example_count
    assert policy.ledger_dir  # persistent by default


def test_sources_override_in_order_and_flower_keys_are_ignored(tmp_path: Path) -> None:
    file = tmp_path / "policy.toml"
    file.write_text('epsilon-budget = 4.0\nallowed-mechanisms = ["dpsgd", "clipped"]\n')
    env = parse_assignments("epsilon-budget=2.0 noise='seeded' release-train-loss=true")
    node = {"partition-id": 0, "num-partitions": 2, "policy-file": str(file)}
    policy = NodePolicy.from_sources(env, node)
    assert policy.epsilon_budget == 4.0  # the node config's file wins over the environment
    assert policy.allowed_mechanisms == ("dpsgd", "clipped")
    assert policy.noise == "seeded" and policy.release_train_loss
    assert NodePolicy.from_sources({"epsilon-budget": "inf"}).epsilon_budget == math.inf
    assert NodePolicy.from_sources({"ledger-dir": ""}).ledger_dir == ""


@pytest.mark.parametrize(
    ("entries", "match"),
    [
        (
            {"epsilon-budgte": 1.0},
            "key 'epsilon-budgte' is unknown; did you mean 'epsilon-budget'",
        ),
        ({"epsilon-budget": "lots"}, "epsilon-budget='lots': expected float"),
        ({"epsilon-budget": -1.0}, r"epsilon-budget=-1.0: expected a value >= 0"),
        ({"noise": "random"}, "noise='random': expected one of fresh, seeded"),
        ({"allowed-mechanisms": "dpsgd,magic"}, "allowed-mechanisms='magic'"),
        ({"max-local-epochs": 0}, "max-local-epochs=0: expected >= 1"),
        ({"release-train-loss": "yes"}, "release-train-loss='yes': expected true or false"),
        ({"policy-file": "/nonexistent/p.toml"}, "policy-file='/nonexistent/p.toml'"),
    ],
)
def test_bad_policy_entries_are_named(entries: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NodePolicy.from_sources(entries)


def test_assignments_parse_like_node_config() -> None:
    assert parse_assignments("a=1 b='x' c=true d=inf e=bare f=") == {
        "a": 1,
        "b": "x",
        "c": True,
        "d": math.inf,
        "e": "bare",
        "f": "",
    }
    with pytest.raises(ValueError, match="'novalue': expected key=value"):
        parse_assignments("novalue")


def test_static_limits() -> None:
    policy = NodePolicy(min_noise_multiplier=0.8, max_local_epochs=2)
    policy.check(request(sigma=0.8))
    with pytest.raises(PrivacyRefusal, match="noise-multiplier=0.79: this node requires >= 0.8"):
        policy.check(request(sigma=0.79))
    with pytest.raises(PrivacyRefusal, match="mechanism='noisy': this node allows only dpsgd"):
        policy.check(request(mechanism="noisy"))
    with pytest.raises(PrivacyRefusal, match="local-epochs=3: this node allows <= 2"):
        policy.check(request(local_epochs=3))


def test_the_ledger_composes_rounds_and_runs_like_one_accountant(tmp_path: Path) -> None:
    ledger = PrivacyLedger(tmp_path / "l" / "digits.json")
    assert ledger.epsilon(1e-5) == 0.0
    for rnd in (1, 2):
        ledger.charge(request(rnd), budget=math.inf, delta=1e-5)
    ledger.charge(request(1, run_id=2), budget=math.inf, delta=1e-5)
    expected = compute_epsilon(
        noise_multiplier=1.0, sample_rate=0.01, steps=300, delta=1e-5, accountant="rdp"
    )
    assert ledger.epsilon(1e-5) == pytest.approx(expected, rel=1e-9)
    # Survives a restart: a new object on the same file.
    assert PrivacyLedger(ledger.path).epsilon(1e-5) == pytest.approx(expected, rel=1e-9)
    assert oct(ledger.path.stat().st_mode & 0o777) == "0o600"


def test_the_ledger_refuses_replays_and_overspending_without_recording(tmp_path: Path) -> None:
    ledger = PrivacyLedger(tmp_path / "x.json")
    spent = ledger.charge(request(3), budget=10, delta=1e-5)
    with pytest.raises(PrivacyRefusal, match="round=3: this node already trained round 3 of run 1"):
        ledger.charge(request(3), budget=10, delta=1e-5)
    with pytest.raises(PrivacyRefusal, match="round=2"):
        ledger.charge(request(2), budget=10, delta=1e-5)
    with pytest.raises(PrivacyRefusal, match="^this round would take .* past its privacy budget$"):
        ledger.charge(request(4), budget=spent * 1.1, delta=1e-5)
    assert len(ledger.entries()) == 1
    with pytest.raises(PrivacyRefusal, match="past its privacy budget") as refused:
        ledger.charge(request(4, mechanism="clipped"), budget=1e9, delta=1e-5)  # inf
    assert "epsilon=inf" in refused.value.detail  # the numbers: for the node's log only


def test_a_damaged_ledger_is_never_read_as_empty(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text("{not json")
    with pytest.raises(PrivacyRefusal, match="unreadable"):
        PrivacyLedger(path).charge(request(1), budget=10, delta=1e-5)
    path.write_text(json.dumps({"format": 99, "entries": []}))
    with pytest.raises(PrivacyRefusal, match="ledger is unreadable") as refused:
        PrivacyLedger(path).epsilon(1e-5)
    assert "format=99" in refused.value.detail and str(path) not in str(refused.value)


def _charge_many(path: str, run_id: int) -> None:
    ledger = PrivacyLedger(Path(path))
    for rnd in range(1, 11):
        ledger.charge(request(rnd, run_id=run_id), budget=math.inf, delta=1e-5)


def test_concurrent_processes_lose_no_entry(tmp_path: Path) -> None:
    path = str(tmp_path / "c.json")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_charge_many, args=(path, run)) for run in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(PrivacyLedger(Path(path)).entries()) == 20


def test_ledger_keys_are_safe_file_names() -> None:
    assert ledger_key("digits", 0, 10) == "digits-partition-0-of-10"
    assert "/" not in ledger_key("../../etc", 1, 2)
    digest = "ab" * 32
    assert ledger_path(Path("/l"), digest) == Path(f"/l/data-{digest}.json")
    for bad in ("../x", "AB" * 32, "ab" * 31, ""):
        with pytest.raises(ValueError, match="expected a SHA-256 hex digest"):
            ledger_path(Path("/l"), bad)


def test_a_content_keyed_ledger_starts_from_the_legacy_one(tmp_path: Path) -> None:
    """An upgraded node keeps what its name-keyed ledger spent; the old file is not charged."""
    legacy = PrivacyLedger(tmp_path / "digits-partition-0-of-2.json")
    legacy.charge(request(1), budget=math.inf, delta=1e-5)
    before = legacy.epsilon(1e-5)
    ledger = PrivacyLedger(tmp_path / f"data-{'0' * 64}.json", legacy=[legacy.path])
    assert ledger.entries() == legacy.entries() and ledger.epsilon(1e-5) == before
    with pytest.raises(PrivacyRefusal, match="round=1: this node already trained round 1"):
        ledger.charge(request(1), budget=math.inf, delta=1e-5)  # the replay guard too
    ledger.charge(request(2), budget=math.inf, delta=1e-5)
    assert [e.server_round for e in PrivacyLedger(ledger.path).entries()] == [1, 2]
    assert len(legacy.entries()) == 1
    with pytest.raises(PrivacyRefusal, match="past its privacy budget"):
        PrivacyLedger(tmp_path / f"data-{'1' * 64}.json", legacy=[legacy.path]).charge(
            request(2), budget=before * 1.01, delta=1e-5
        )


def test_static_limits_are_checked_before_anything_is_computed() -> None:
    policy = NodePolicy(min_noise_multiplier=0.8, max_local_epochs=2)
    policy.precheck(mechanism="dpsgd", local_epochs=2, noise_multiplier=None)  # calibrated later
    with pytest.raises(PrivacyRefusal, match="noise-multiplier=0.5: this node requires >= 0.8"):
        policy.precheck(mechanism="dpsgd", local_epochs=1, noise_multiplier=0.5)
    with pytest.raises(PrivacyRefusal, match="local-epochs=3"):
        policy.precheck(mechanism="dpsgd", local_epochs=3, noise_multiplier=None)
    # A σ the node calibrated depends on its data size: the refusal does not name it.
    with pytest.raises(PrivacyRefusal, match="calibrates to on this node is below") as refused:
        policy.check(request(sigma=0.7312, calibrated=True))
    assert "0.7312" not in str(refused.value) and "0.7312" in refused.value.detail


def test_fab_hashes_must_be_sha256_digests() -> None:
    digest = "0f" * 32
    policy = NodePolicy.from_sources({"allowed-fab-hashes": f"{digest}, {'a1' * 32}"})
    assert policy.allowed_fab_hashes == (digest, "a1" * 32)
    with pytest.raises(ValueError, match="allowed-fab-hashes='xyz': expected SHA-256"):
        NodePolicy.from_sources({"allowed-fab-hashes": "xyz"})
    assert NodePolicy().allowed_fab_hashes == () and not NodePolicy().evaluate


def test_plugins_are_refused_unless_listed_for_their_role_or_simulated() -> None:
    spec, net = "their_pkg.methods:Pruning", "their_pkg.nets:cnn"
    assert NodePolicy().plugin_methods == () and NodePolicy().plugin_models == ()
    with pytest.raises(
        PrivacyRefusal, match=r"method='their_pkg.methods:Pruning': .*plugin-methods"
    ):
        NodePolicy().check_plugins({"method": spec})
    with pytest.raises(PrivacyRefusal, match=r"model='their_pkg.nets:cnn': .*plugin-models"):
        NodePolicy().check_plugins({"method": "rs", "model": net})
    listed = NodePolicy.from_sources({"plugin-methods": f"{spec}, x.y:Z", "plugin-models": net})
    assert listed.plugin_methods == (spec, "x.y:Z") and listed.plugin_models == (net,)
    listed.check_plugins({"method": spec, "model": net})
    with pytest.raises(PrivacyRefusal, match="plugin-methods"):
        listed.check_plugins({"method": "their_pkg.methods:Other"})
    # a name listed for one role is refused in the other: a model factory is not a method
    with pytest.raises(PrivacyRefusal, match=r"method='their_pkg.nets:cnn'"):
        listed.check_plugins({"method": net})
    with pytest.raises(PrivacyRefusal, match=r"model='their_pkg.methods:Pruning'"):
        listed.check_plugins({"model": spec})
    # a simulated node: the experimenter's run
    NodePolicy(noise="seeded").check_plugins({"method": spec, "model": "x.y:z"})
    for builtin in ("rs", "lf", "gip"):  # built-in names are never plug-ins
        NodePolicy().check_plugins({"method": builtin, "model": "digits-cnn"})


def test_plugin_method_entries_must_be_module_colon_class() -> None:
    with pytest.raises(ValueError, match=r"node policy: plugin-methods='rs': expected"):
        NodePolicy(plugin_methods=("rs",))
    with pytest.raises(ValueError, match=r"plugin-models='a-b:C'"):
        NodePolicy.from_sources({"plugin-models": "a-b:C"})


def test_secure_aggregation_policy_requires_refuses_and_bounds_the_nodes_share() -> None:
    from fedsparse.client.node_policy import SECAGG

    allow = NodePolicy(min_noise_multiplier=0.5)
    allow.precheck(mechanism=SECAGG, local_epochs=1, noise_multiplier=1.0)
    with pytest.raises(PrivacyRefusal, match="is 0.45 for its data; this node requires >= 0.5"):
        allow.precheck(mechanism=SECAGG, local_epochs=1, noise_multiplier=0.9)
    require = NodePolicy(secure_aggregation="require")
    require.precheck(mechanism=SECAGG, local_epochs=1, noise_multiplier=1.0)
    with pytest.raises(PrivacyRefusal, match="secure-aggregation=false"):
        require.precheck(mechanism="dpsgd", local_epochs=1, noise_multiplier=1.0)
    refuse = NodePolicy(secure_aggregation="refuse")
    with pytest.raises(PrivacyRefusal, match="refuses secure aggregation"):
        refuse.precheck(mechanism=SECAGG, local_epochs=1, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="secure-aggregation='sometimes'"):
        NodePolicy.from_sources({"secure-aggregation": "sometimes"})
    with pytest.raises(ValueError, match="secagg-colluders=-1"):
        NodePolicy.from_sources({"secagg-colluders": -1})
    assert NodePolicy.from_sources({"secagg-colluders": "2"}).secagg_colluders == 2


def test_a_secure_aggregation_round_is_charged_at_half_its_worst_case_multiplier(
    tmp_path: Path,
) -> None:
    """One example moves a clipped update by up to 2C: the node's share of noise, sigma_wc,
    is a multiplier of sigma_wc / 2 for its data, at rate 1, one step a round; ledger and
    the ledger-less guard agree."""
    from fedsparse.client.guard import authorize
    from fedsparse.client.node_policy import SECAGG
    from fedsparse.common.dp.accounting import compute_epsilon_of_history

    ledger = PrivacyLedger(tmp_path / "l" / "data.json")
    secure = [
        TrainingRequest(
            run_id=1,
            server_round=rnd,
            mechanism=SECAGG,
            noise_multiplier=0.9,
            sample_rate=1.0,
            steps=1,
            local_epochs=1,
        )
        for rnd in (1, 2)
    ]
    policy = NodePolicy(min_noise_multiplier=0.45, epsilon_budget=math.inf)
    for req in secure:
        ledger.charge(req, budget=math.inf, delta=1e-5)
    expected = compute_epsilon_of_history([(0.45, 1.0, 2)], delta=1e-5, accountant="rdp")
    assert ledger.epsilon(1e-5) == pytest.approx(expected, rel=1e-12)
    assert [e.mechanism for e in ledger.entries()] == ["secagg", "secagg"]
    without = authorize(policy, None, secure[1], history=[(0.45, 1.0, 1)], last_round=1)
    assert without == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("partition", "path"), [(3, "/k/node-3.pem"), ("4", "/k/node-4.pem")])
def test_the_identity_path_takes_the_nodes_partition_id(partition: object, path: str) -> None:
    """One policy for many nodes (a simulation's environment): a key file each."""
    template = {"secagg-identity": "/k/node-{partition-id}.pem"}
    policy = NodePolicy.from_sources(template, {"partition-id": partition})
    assert policy.secagg_identity == path
    assert NodePolicy.from_sources({"secagg-identity": "/k/a.pem"}).secagg_identity == "/k/a.pem"


@pytest.mark.parametrize("partition", [None, -1, "x", True, 1.5])
def test_an_identity_template_without_a_partition_id_is_refused(partition: object) -> None:
    source = {} if partition is None else {"partition-id": partition}
    with pytest.raises(ValueError, match=r"secagg-identity='/k/\{partition-id\}': names "):
        NodePolicy.from_sources({"secagg-identity": "/k/{partition-id}"}, source)


def test_identities_for_n_nodes_and_their_roster(tmp_path: Path) -> None:
    from fedsparse.client.secagg_identity import Identity, load_roster, write_identities

    roster = write_identities(tmp_path / "keys", 3)
    keys = [Identity.load(tmp_path / "keys" / f"node-{i}.pem").public for i in range(3)]
    assert load_roster(roster) == frozenset(keys) and len(set(keys)) == 3
    assert all((tmp_path / "keys" / f"node-{i}.pem").stat().st_mode & 0o077 == 0 for i in range(3))
    with pytest.raises(FileExistsError):
        write_identities(tmp_path / "keys", 3)  # nothing overwritten
    with pytest.raises(ValueError, match=r"count=0"):
        write_identities(tmp_path / "other", 0)


def test_the_identity_takes_the_node_configs_partition_id_not_a_policy_files(
    tmp_path: Path,
) -> None:
    """A reviewer's case: a policy file's partition-id (which the node's data never reads)
    does not choose the key."""
    policy = tmp_path / "policy.toml"
    policy.write_text('secagg-identity = "/k/node-{partition-id}.pem"\npartition-id = 5\n')
    with pytest.raises(ValueError, match=r"partition-id=None"):
        NodePolicy.from_sources({"policy-file": str(policy)})
    both = NodePolicy.from_sources({"policy-file": str(policy), "partition-id": 2})
    assert both.secagg_identity == "/k/node-2.pem"


def test_identities_are_written_all_or_nothing_and_never_through_a_link(tmp_path: Path) -> None:
    from fedsparse.client.secagg_identity import write_identities

    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "node-2.pem").write_text("an owner's key")
    with pytest.raises(FileExistsError, match=r"node-2.pem"):
        write_identities(keys, 3)
    assert sorted(p.name for p in keys.iterdir()) == ["node-2.pem"]  # nothing else written
    other = tmp_path / "other"
    other.mkdir()
    (other / "roster.txt").symlink_to(tmp_path / "elsewhere.txt")  # dangling
    with pytest.raises(FileExistsError, match=r"roster.txt"):
        write_identities(other, 1)
    assert not (tmp_path / "elsewhere.txt").exists() and not (other / "node-0.pem").exists()
