"""Error feedback end to end: an in-process int4 federation with ``error-feedback=true`` runs,
records the key, keeps each node's residual in its state files, and a killed and resumed run
equals the uninterrupted one bit for bit (the residual restored from the files)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fedsparse.client.state import residual_vector
from fedsparse.common.layout import ParamLayout
from fedsparse.common.models.classifiers import build_model
from fedsparse.server.app import run_federated
from fedsparse.server.norm_bound import derived_bound
from fedsparse.server.strategy import SparseFedAvg
from tests.integration.test_resume import (
    NODES,
    _assert_same_run,
    _cfg,
    _grid,
    _killed_then_resumed,
    _lines,
    _sim_policy,
    _weights,
)

pytestmark = pytest.mark.slow

EF: dict[str, Any] = dict(
    value_dtype="int4", value_block=64, error_feedback=True, dp_norm_bound="off"
)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ef")
    cfg = _cfg(out, **EF)
    run_federated(_grid(cfg, _sim_policy(out)), cfg)
    return out


def test_an_int4_federation_with_error_feedback_runs_and_records_the_key(
    uninterrupted: Path, tmp_path: Path
) -> None:
    rounds = _lines(uninterrupted)
    assert [(r["num_accepted"], r["rejected"]) for r in rounds] == [(2, [])] * 4
    summary = json.loads((uninterrupted / "summary.json").read_text())
    assert summary["config"]["error-feedback"] is True
    assert summary["config"]["value-dtype"] == "int4"
    # every node that trained keeps a residual of the model's size, nonzero on what it sent
    cfg = _cfg(uninterrupted, **EF)
    d = ParamLayout.from_module(build_model(cfg.model_name, seed=cfg.seed)).numel
    files = sorted(uninterrupted.rglob("round-*.json"))
    assert {p.parent.name for p in files} == {f"node-{i}" for i in range(NODES)}
    for path in files:
        raw = base64.b64decode(json.loads(path.read_text())["ef-residual"])
        residual = residual_vector(raw, d)
        assert bool(torch.isfinite(residual).all()) and bool((residual != 0).any())
    # the same run without it: the same bytes a round, other weights
    off = tmp_path / "off"
    plain = _cfg(off, value_dtype="int4", value_block=64)
    run_federated(_grid(plain, _sim_policy(off)), plain)
    assert [r["uplink_payload_bytes"] for r in _lines(off)] == [
        r["uplink_payload_bytes"] for r in rounds
    ]
    assert not torch.equal(_weights(off), _weights(uninterrupted))
    assert all("ef-residual" not in json.loads(p.read_text()) for p in off.rglob("round-*.json"))
    assert json.loads((off / "summary.json").read_text())["config"]["error-feedback"] is False


def test_a_killed_error_feedback_run_resumes_to_the_uninterrupted_run(
    uninterrupted: Path, tmp_path: Path
) -> None:
    _killed_then_resumed(tmp_path, _sim_policy(tmp_path), **EF)
    _assert_same_run(tmp_path, uninterrupted)


def test_an_int4_federation_with_error_feedback_keeps_the_derived_bound(tmp_path: Path) -> None:
    """int4's rounding error contracts when fed back, so ``dp-norm-bound='auto'`` stays on
    (values plus residual bounded): every honest reply is accepted, under a bound that says
    it covers error feedback."""
    cfg = _cfg(tmp_path, value_dtype="int4", value_block=64, error_feedback=True)
    assert cfg.dp_norm_bound == "auto"
    run_federated(_grid(cfg, _sim_policy(tmp_path)), cfg)
    assert [(r["num_accepted"], r["rejected"]) for r in _lines(tmp_path)] == [(2, [])] * 4
    d = ParamLayout.from_module(build_model(cfg.model_name, seed=cfg.seed)).numel
    caps = SparseFedAvg(cfg, num_parameters=d).honest_bound()
    assert caps is not None and caps.feedback_keep == d
    bound, how = derived_bound(caps, keep=d // 10, d=d, selects_per_step=False)
    assert how.endswith(f"; error feedback, rounds of <={d} values") and bound < float("inf")
