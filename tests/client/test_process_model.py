"""A process reuses one model across its clients' train calls and changes no number."""

import json
from pathlib import Path

import pytest
import torch

from fedsparse.client import local_round, model_cache
from fedsparse.client.app import app as client_app
from fedsparse.common.config import FederatedConfig
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.app import run_federated

TIMING_KEYS = {"wall_seconds", "started_at", "ended_at"}


def federate(tmp_path: Path, **kwargs) -> list[dict]:
    cfg = FederatedConfig(out_dir=str(tmp_path), **kwargs)
    grid = InProcessGrid(client_app, num_nodes=3, run_config=cfg.to_run_config())
    run_federated(grid, cfg)
    lines = (tmp_path / "rounds.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines]


def rebuilt_every_call(monkeypatch: pytest.MonkeyPatch) -> list[torch.nn.Module]:
    """Makes every train call build its own model, as before the reuse; returns them."""
    built: list[torch.nn.Module] = []
    build = model_cache.process_model.__wrapped__

    def fresh(name: str, seed: int) -> model_cache.ProcessModel:
        process_model = build(name, seed)
        built.append(process_model.model)
        return process_model

    monkeypatch.setattr(model_cache, "process_model", fresh)
    return built


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_rounds=2, final_rate=0.7, target_epsilon=3.0),
        dict(num_rounds=2, final_rate=0.5, engine="func", local_epochs=2),
        dict(num_rounds=2, final_rate=0.5, engine="opacus", target_epsilon=3.0),
        dict(num_rounds=2, method="gip", final_rate=0.9, target_epsilon=3.0),
        dict(num_rounds=2, method="lf", freeze_after=1, target_epsilon=3.0),
    ],
)
def test_rounds_equal_with_the_model_reused_or_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kwargs
) -> None:
    """Accuracy, ε, losses and bytes of every round, compared exactly."""
    model_cache.process_model.cache_clear()
    reused = federate(tmp_path / "reused", **kwargs)
    assert model_cache.process_model.cache_info().hits >= 3 * 2 - 1  # it was reused
    built = rebuilt_every_call(monkeypatch)
    rebuilt = federate(tmp_path / "rebuilt", **kwargs)
    assert len(built) == 3 * 2  # one model per train call
    assert len(reused) == 2
    assert reused == rebuilt


def assert_clean(model: torch.nn.Module) -> None:
    """No Opacus hook, per-layer activation or per-parameter gradient state is left."""
    for layer in model.modules():
        assert not layer._forward_hooks and not layer._backward_hooks
        assert not getattr(layer, "_forward_pre_hooks", None)
        assert "activations" not in layer.__dict__
    for p in model.parameters():
        assert p.grad is None
        for name in ("grad_sample", "summed_grad", "_current_grad_sample", "_forward_counter"):
            assert not hasattr(p, name), name


@pytest.mark.slow
def test_a_failed_call_leaves_the_model_clean_and_the_next_round_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call that raises mid-epoch leaves no hooks behind: later calls equal fresh ones."""
    kwargs = dict(num_rounds=2, final_rate=0.7, target_epsilon=3.0)
    model_cache.process_model.cache_clear()
    expected = federate(tmp_path / "expected", **kwargs)
    process_model = model_cache.process_model("digits-cnn", 0)
    assert_clean(process_model.model)

    real_epoch, calls = local_round.train_one_epoch, []

    def fail_once(module, optimizer, loader, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            next(iter(loader))  # the Poisson loader ran and hooks are on
            module(torch.zeros(2, 1, 8, 8)).sum().backward()  # activations, grad samples
            raise RuntimeError("killed mid-epoch")
        return real_epoch(module, optimizer, loader, **kwargs)

    monkeypatch.setattr(local_round, "train_one_epoch", fail_once)
    failed = federate(tmp_path / "failed", **kwargs)
    assert failed[0]["num_accepted"] == 2  # the round went on without that client
    assert_clean(process_model.model)
    monkeypatch.setattr(local_round, "train_one_epoch", real_epoch)
    after = federate(tmp_path / "after", **kwargs)
    assert after == expected
