"""A user's DP engine from a package outside the repository, by ``engine=package.module:spec``.

The package (``tests/plugin_package.py``: ``engines.counting``) is written into ``tmp_path``
and put on ``sys.path``; fedsparse is not touched and nothing is registered: the one file and
its ``EngineSpec`` are the whole extension. Its engine is the func engine with every batch
counted, so its effect is exact: a federation trained on it ends bit for bit where the func
engine's ends, and its count says it ran. A deployed node imports it only if its owner lists
it (``plugin-engines``); the population backend runs such a round on ``client_round``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from flwr.app import Message

import fedsparse.client.train_message as train_message_module
from fedsparse.client.app import app as client_app
from fedsparse.client.node_policy import SIMULATION_NODE_POLICY, NodePolicy, PrivacyRefusal
from fedsparse.common.config import FederatedConfig
from fedsparse.common.dp.engines import engine_spec, select_engine
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.training.configs import TrainConfig, planned_engine
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.lab.simulation.population import PopulationGrid
from fedsparse.server.app import run_federated
from fedsparse.server.messages import train_message
from tests.client.round_helpers import first_task, weights
from tests.plugin_package import PACKAGE, user_package

SPEC = f"{PACKAGE}.engines:counting"
CPU = torch.device("cpu")


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The user package on ``sys.path``, not yet imported; its engine's reference."""
    with user_package(tmp_path / "site", monkeypatch):
        yield SPEC


def _federation(
    engine: str, out: Path, *, population: bool = False, num_rounds: int = 2
) -> list[dict[str, object]]:
    """``num_rounds`` rounds of two simulated nodes on ``engine``; the rounds recorded."""
    cfg = FederatedConfig(
        num_rounds=num_rounds,
        target_epsilon=0.0,
        noise_multiplier=1.0,
        seed=3,
        engine=engine,
        out_dir=str(out),
    )
    grid_class = PopulationGrid if population else InProcessGrid
    grid = grid_class(
        client_app,
        num_nodes=2,
        run_config=cfg.to_run_config(),
        node_config=SIMULATION_NODE_POLICY,
    )
    run_federated(grid, cfg)
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


def test_a_plugin_engine_trains_a_federation_as_the_engine_it_extends(
    plugin: str, tmp_path: Path
) -> None:
    ours = _federation(plugin, tmp_path / "plugin")
    batches = sys.modules[f"{PACKAGE}.engines"].BATCHES
    assert len(batches) > 0 and sum(batches) > 0  # it computed the per-sample gradients
    func = _federation("func", tmp_path / "func")
    ours_end = torch.load(tmp_path / "plugin" / "checkpoint.pt")["weights"]
    func_end = torch.load(tmp_path / "func" / "checkpoint.pt")["weights"]
    assert torch.equal(ours_end, func_end)  # the same mechanism, the same streams: bit for bit
    same = ("epsilon_max", "uplink_payload_bytes", "keep", "test_accuracy", "num_accepted")
    assert [[r[k] for k in same] for r in ours] == [[r[k] for k in same] for r in func]
    assert planned_engine(plugin, "digits-cnn") == plugin  # what the run records call it


def test_the_population_backend_runs_a_plugin_engines_rounds_on_client_round(
    plugin: str, tmp_path: Path
) -> None:
    rounds = _federation(plugin, tmp_path / "run", population=True, num_rounds=1)
    assert sys.modules[f"{PACKAGE}.engines"].BATCHES  # client_round ran it
    assert [r["num_accepted"] for r in rounds] == [2]


def test_an_engine_reference_must_name_an_engine_that_trains_the_model(plugin: str) -> None:
    model = build_model("digits-cnn")
    assert select_engine(plugin, module=model, device=CPU) == plugin
    assert engine_spec(plugin).name == "counting"
    with pytest.raises(ValueError, match=r"^engine='no-conv': this engine trains no Conv2d"):
        select_engine(f"{PACKAGE}.engines:no_conv", module=model, device=CPU)
    with pytest.raises(ValueError, match=r"EngineSpec, got int$"):
        engine_spec(f"{PACKAGE}.engines:not_a_spec")
    with pytest.raises(ValueError, match=r"cannot import 'fedsparse_missing.mod'"):
        engine_spec("fedsparse_missing.mod:spec")
    unknown = r"^engine='jax': expected one of auto, opacus, func, factored, or package"
    for build in (lambda: TrainConfig(engine="jax"), lambda: FederatedConfig(engine="jax")):
        with pytest.raises(ValueError, match=unknown):
            build()
    assert TrainConfig(engine=plugin).engine == plugin  # checked where it loads, not here


def test_an_engine_that_builds_no_sparse_dp_engine_is_refused(plugin: str, tmp_path: Path) -> None:
    from fedsparse.common.training.local import make_private

    bad = f"{PACKAGE}.engines:builds_something_else"
    cfg = FederatedConfig(target_epsilon=0.0, noise_multiplier=1.0, engine=bad)
    x, y = torch.zeros(8, 1, 8, 8), torch.zeros(8, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"built a NotAnEngine, expected a fedsparse"):
        make_private(
            build_model("digits-cnn"),
            x,
            y,
            privacy=cfg.privacy(),
            train=TrainConfig(engine=bad),
            epochs_for_target=1,
        )


def test_a_deployed_node_imports_only_the_plugin_engines_its_owner_lists(plugin: str) -> None:
    run_config = {**FederatedConfig().to_run_config(), "engine": plugin}
    with pytest.raises(PrivacyRefusal, match=r"engine='.*': .*plugin-engines"):
        NodePolicy().check_plugins(run_config)
    assert PACKAGE not in sys.modules  # refused before anything was imported
    NodePolicy(plugin_engines=(plugin,)).check_plugins(run_config)
    with pytest.raises(PrivacyRefusal, match="plugin-engines"):  # listed for another role
        NodePolicy(plugin_methods=(plugin,)).check_plugins(run_config)
    NodePolicy.from_sources(SIMULATION_NODE_POLICY).check_plugins(run_config)  # simulated
    with pytest.raises(ValueError, match=r"plugin-engines='auto': expected"):
        NodePolicy(plugin_engines=("auto",))


DEPLOYED = {"ledger-dir": "", "dataset": "digits", "nominal-size": 1437}


def _ask(node_config: dict[str, object], engine: str) -> Message:
    """A round-1 train instruction of a run on ``engine`` to a node (in process); its reply."""
    cfg = FederatedConfig(
        num_rounds=3, target_epsilon=0.0, noise_multiplier=1.0, schedule="constant", final_rate=0
    )
    run_config = {**cfg.to_run_config(), "engine": engine}  # as a server sends it: not imported
    grid = InProcessGrid(client_app, num_nodes=1, run_config=run_config, node_config=node_config)
    (reply,) = grid.send_and_receive([train_message(first_task(cfg, weights(cfg)), node=1001)])
    return reply


def test_a_deployed_node_refuses_an_unlisted_engine_and_checks_a_listed_one_before_charging(
    plugin: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reply = _ask(DEPLOYED, plugin)
    assert reply.has_error() and "plugin-engines" in reply.error.reason
    assert PACKAGE not in sys.modules  # refused before anything was imported
    charged = []
    authorized = train_message_module._authorized
    monkeypatch.setattr(
        train_message_module,
        "_authorized",
        lambda *args: charged.append(1) or authorized(*args),
    )
    broken = f"{PACKAGE}.engines:no_conv"  # listed, but it cannot train the model
    assert _ask({**DEPLOYED, "plugin-engines": broken}, broken).has_error()
    assert charged == []  # refused before the node's budget was touched
    reply = _ask({**DEPLOYED, "plugin-engines": plugin}, plugin)
    assert not reply.has_error(), reply.error.reason
    assert charged == [1] and sys.modules[f"{PACKAGE}.engines"].BATCHES
