"""A user's ``Method`` from a package outside the repository, by ``method=package.module:Class``.

The package (``tests/plugin_package.py``) is written into ``tmp_path`` and put on ``sys.path``
(the federation runs in this process: ``InProcessGrid``); fedsparse is not touched. Its
method trains the even coordinates only, so its effect is exact: every odd coordinate ends
where it started, federated and centralized. A deployed node imports it only if its owner
lists it (``plugin-methods``) and refuses before importing anything otherwise; a simulated
node imports it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fedsparse.client.app import app as client_app
from fedsparse.client.node_policy import SIMULATION_NODE_POLICY
from fedsparse.common.config import FederatedConfig
from fedsparse.common.data.datasets import load_dataset
from fedsparse.common.layout import ParamLayout
from fedsparse.common.methods import MethodConfig, method_class
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.training.centralized import train_centralized
from fedsparse.common.training.configs import PrivacyConfig, SparsityConfig, TrainConfig
from fedsparse.common.wire.payload import encode_update
from fedsparse.common.wire.payload.indices import indices_to_bytes
from fedsparse.common.wire.protocol import (
    CONFIG_RECORD,
    METRICS_RECORD,
    TrainInstruction,
    TrainReply,
)
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.app import run_federated
from fedsparse.server.messages import train_message
from tests.plugin_package import PACKAGE, user_package

SPEC = f"{PACKAGE}.even:EvenCoordinates"


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The user package (``tests/plugin_package.py``) on ``sys.path``, not yet imported; its
    method."""
    with user_package(tmp_path / "site", monkeypatch):
        yield SPEC


def _initial(cfg: FederatedConfig) -> torch.Tensor:
    model = build_model(cfg.model_name, seed=cfg.seed)
    return ParamLayout.from_module(model).flatten_module(model)


def _moved(start: torch.Tensor, end: torch.Tensor, stride: int) -> tuple[bool, float]:
    """(whether a coordinate off the stride moved, the share of the stride's that did)."""
    on = torch.zeros(start.numel(), dtype=torch.bool)
    on[::stride] = True
    return bool((end[~on] != start[~on]).any()), float((end[on] != start[on]).float().mean())


def test_a_plugin_method_runs_federated_with_its_own_key(plugin: str, tmp_path: Path) -> None:
    base = FederatedConfig(num_rounds=2, target_epsilon=0.0, noise_multiplier=1.0, seed=3)
    # what `fedsparse simulate --set method=... --set stride=3` hands the apps
    run_config = {
        **base.to_run_config(),
        "method": plugin,
        "method-options": "stride=3",
        "out-dir": str(tmp_path / "run"),
    }
    cfg = FederatedConfig.from_run_config(run_config)
    assert cfg.plugin_options() == (("stride", 3),)
    assert cfg.to_run_config() == run_config  # the key travels to every node
    # a mapping built in Python may hold the key at the top level: it goes to its carrier
    top = {k: v for k, v in run_config.items() if k != "method-options"}
    assert FederatedConfig.from_run_config({**top, "stride": "3"}) == cfg
    grid = InProcessGrid(
        client_app, num_nodes=2, run_config=run_config, node_config=SIMULATION_NODE_POLICY
    )
    run_federated(grid, cfg)
    start = _initial(cfg)
    end = torch.load(tmp_path / "run" / "checkpoint.pt")["weights"]
    d = start.numel()
    off_moved, on_share = _moved(start, end, 3)
    assert not off_moved and on_share > 0.9  # bit for bit: only the stride trained
    rounds = [json.loads(x) for x in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert [r["keep"] for r in rounds] == [len(range(0, d, 3))] * 2
    assert [(r["num_accepted"], r["num_rejected"]) for r in rounds] == [(2, 0)] * 2


def test_a_plugin_method_runs_centralized_with_its_own_key(plugin: str) -> None:
    train, test = load_dataset("digits", seed=0)
    model = build_model("digits-cnn", seed=0)
    layout = ParamLayout.from_module(model)
    start = layout.flatten_module(model).clone()
    masks: list[torch.Tensor | None] = []
    stats = train_centralized(
        model,
        (train.x[:512], train.y[:512]),
        (test.x[:128], test.y[:128]),
        privacy=PrivacyConfig(noise_multiplier=1.0, target_epsilon=None, max_grad_norm=1.0),
        sparsity=SparsityConfig(schedule="constant", final_rate=0.0, mask_seed=3),
        train=TrainConfig(epochs=2, batch_size=64, lr=0.5, momentum=0.9, seed=1),
        method=MethodConfig(name=plugin, options=(("stride", 3),)),
        on_mask=lambda _, mask: masks.append(mask),
    )
    assert [s.rate for s in stats] == [pytest.approx(2 / 3)] * 2
    stride = torch.arange(0, start.numel(), 3)
    assert all(m is not None and torch.equal(torch.nonzero(m).flatten(), stride) for m in masks)
    off_moved, on_share = _moved(start, layout.flatten_module(model), 3)
    assert not off_moved and on_share > 0.9


def test_a_plugin_key_is_checked_against_the_method(plugin: str) -> None:
    with pytest.raises(
        ValueError, match="run config key 'strid' is unknown; did you mean 'stride'"
    ):
        FederatedConfig.from_run_config({"method": plugin, "strid": 3})
    with pytest.raises(ValueError, match="run config key 'stride' is unknown"):
        FederatedConfig.from_run_config({"method": "rs", "stride": 3})
    with pytest.raises(ValueError, match=r"method='.*': method-options key 'other' is unknown"):
        FederatedConfig(method=plugin, method_options="other=1")
    with pytest.raises(ValueError, match=r"method='.*': key 'other' is unknown"):
        MethodConfig(name=plugin, options=(("other", 1),)).method()


def test_method_options_are_parsed_and_written_one_way(plugin: str) -> None:
    cfg = FederatedConfig.from_run_config({"method": plugin, "method-options": " stride = 3 ;"})
    assert cfg.method_options == "stride=3" and cfg.plugin_options() == (("stride", 3),)
    assert FederatedConfig(method=plugin, method_options="stride=03") == cfg
    with pytest.raises(ValueError, match=r"^method-options: stride='x': expected int$"):
        FederatedConfig(method=plugin, method_options="stride=x")
    with pytest.raises(ValueError, match="key 'num-round' is unknown; did you mean 'num-rounds'"):
        FederatedConfig(method=plugin, method_options="num-round=3")
    with pytest.raises(ValueError, match=r"^stride=3: expected it once \(also in method-options="):
        FederatedConfig.from_run_config(
            {"method": plugin, "stride": 3, "method-options": "stride=2"}
        )


def test_set_puts_a_plugins_own_keys_in_method_options(plugin: str, tmp_path: Path) -> None:
    import typer

    from fedsparse.lab.cli.utils import check_run_config, parse_sets
    from fedsparse.lab.launch.base import prepare_run

    sets = parse_sets([f"method={plugin}", "stride=3", "num-rounds=2"])
    assert sets == {"method": plugin, "num-rounds": "2", "method-options": "stride=3"}
    check_run_config(sets)  # only keys pyproject.toml declares: what flwr run takes
    assert FederatedConfig.from_run_config(sets).plugin_options() == (("stride", 3),)
    assert parse_sets(["stride=3"]) == {"stride": "3"}  # no plug-in: an unknown key, as before
    with pytest.raises(typer.BadParameter, match="--set stride=3: also in method-options="):
        parse_sets([f"method={plugin}", "stride=3", "method-options=stride=2"])
    # a top-level key given in Python (a sweep's grid) reaches flwr run in its carrier too
    run = prepare_run(tmp_path / "run", {"method": plugin, "stride": "3"}, check_data=False)
    assert run.run_config["method-options"] == "stride=3" and "stride" not in run.run_config


def _ask(node_config: dict[str, object], run_config: dict[str, object]) -> object:
    """One round-1 instruction for the even coordinates to a node; its reply message."""
    cfg = FederatedConfig(num_rounds=3, target_epsilon=0.0, noise_multiplier=1.0)
    flat = _initial(cfg)
    d = flat.numel()
    support = torch.arange(0, d, 2)
    task = TrainInstruction(
        server_round=1,
        num_rounds=3,
        mask_seed=1,
        keep=support.numel(),
        mask_scope="round",
        local_epochs=1,
        batch_size=32,
        lr=0.5,
        momentum=0.0,
        base_version=-1,
        model_version=0,
        model=encode_update(flat, dense_size=d, round=1),
    )
    grid = InProcessGrid(client_app, num_nodes=1, run_config=run_config, node_config=node_config)
    bitmap = indices_to_bytes(support.numpy(), "bitmap", d)
    (reply,) = grid.send_and_receive([train_message(task, node=1001, support=bitmap)])
    return reply


def _run_config(method: str) -> dict[str, object]:
    """A run config naming ``method``, built without importing it (as a server sends it)."""
    cfg = FederatedConfig(num_rounds=3, target_epsilon=0.0, noise_multiplier=1.0)
    return {**cfg.to_run_config(), "method": method}


DEPLOYED = {"ledger-dir": "", "dataset": "digits", "nominal-size": 1437}


def test_a_deployed_node_refuses_an_unlisted_plugin_before_importing_it(plugin: str) -> None:
    reply = _ask(DEPLOYED, _run_config(plugin))
    assert reply.has_error()
    assert f"method={plugin!r}" in reply.error.reason
    assert "plugin-methods" in reply.error.reason
    assert PACKAGE not in sys.modules  # nothing of it was imported, not even the package


def test_a_deployed_node_runs_a_plugin_its_owner_lists(plugin: str) -> None:
    reply = _ask({**DEPLOYED, "plugin-methods": plugin}, _run_config(plugin))
    assert not reply.has_error(), reply.error.reason
    parsed = TrainReply.from_records(
        reply.content.config_records[CONFIG_RECORD], reply.content.metric_records[METRICS_RECORD]
    )
    assert parsed.keep == (_initial(FederatedConfig()).numel() + 1) // 2
    assert sys.modules[f"{PACKAGE}.even"].LOADED


def test_a_simulated_node_imports_a_plugin_and_builtins_import_nothing(plugin: str) -> None:
    reply = _ask(dict(SIMULATION_NODE_POLICY), _run_config(plugin))
    assert not reply.has_error(), reply.error.reason
    assert f"{PACKAGE}.even" in sys.modules
    before = set(sys.modules)
    for name in ("rs", "lf", "ranked", "dpssgd", "gip", "random-k", "random-freeze"):
        method_class(name)
    assert set(sys.modules) == before


def test_a_plugin_name_must_name_a_method(plugin: str) -> None:
    with pytest.raises(ValueError, match=r"method='no-such': expected one of rs, "):
        FederatedConfig(method="no-such")
    with pytest.raises(ValueError, match=r"cannot import 'fedsparse_missing.mod'"):
        FederatedConfig(method="fedsparse_missing.mod:Cls")
    with pytest.raises(ValueError, match="has no attribute 'even'"):
        FederatedConfig(method=f"{PACKAGE}.even:even")
    with pytest.raises(ValueError, match="expected a fedsparse.common.methods.Method subclass"):
        FederatedConfig(method=f"{PACKAGE}.even:__name__")


def test_a_user_model_and_dataset_run_federated_through_the_run_config(
    plugin: str, tmp_path: Path
) -> None:
    base = FederatedConfig(num_rounds=3, target_epsilon=0.0, noise_multiplier=0.5, seed=3)
    # what `fedsparse simulate --set model=... --set dataset=...` hands the apps
    run_config = {
        **base.to_run_config(),
        "model": f"{PACKAGE}:tiny_cnn",
        "dataset": f"{PACKAGE}:more_stripes",
        "lr": 0.5,
        "out-dir": str(tmp_path / "run"),
    }
    cfg = FederatedConfig.from_run_config(run_config)
    grid = InProcessGrid(
        client_app, num_nodes=2, run_config=run_config, node_config=SIMULATION_NODE_POLICY
    )
    summary = run_federated(grid, cfg)
    rounds = [json.loads(x) for x in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert [(r["num_accepted"], r["num_rejected"]) for r in rounds] == [(2, 0)] * 3
    d = sum(p.numel() for p in build_model(cfg.model_name, seed=0).parameters())
    assert rounds[0]["dense_uplink_bytes"] == 2 * 4 * d  # the user's model: 4 d bytes a client
    assert summary.final_test_accuracy >= 0.5  # 6 bright rows: learnt (chance is 1/6)


def test_a_deployed_node_refuses_a_user_model_it_does_not_list(tmp_path: Path) -> None:
    # The server names a model in a module this node never imports: refused first, in the
    # reply's one line, and the module stays unimported (its code never runs).
    run_config = {**_run_config("rs"), "model": "fedsparse_never_imported.nets:cnn"}
    reply = _ask(DEPLOYED, run_config)
    assert reply.has_error()
    assert "model='fedsparse_never_imported.nets:cnn'" in reply.error.reason
    assert "plugin-models" in reply.error.reason
    assert "fedsparse_never_imported" not in sys.modules


def test_train_takes_a_user_model_dataset_and_method(plugin: str, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from fedsparse.lab.cli import app

    lab = PACKAGE
    out = tmp_path / "train"
    args = ["train", "--out", str(out), "--epochs", "2", "--dataset", f"{lab}:more_stripes"]
    result = CliRunner().invoke(app, [*args, "--model", f"{lab}:tiny_cnn", "--method", plugin])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == f"{lab}:tiny_cnn" and summary["method"]["name"] == plugin
    assert summary["mean_keep_fraction"] == pytest.approx(0.5, abs=0.01)  # stride 2
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "no-model")])
    assert result.exit_code == 2 and "needs --model" in " ".join(result.output.split())
