"""Uplink bits per parameter from a real federated run (real ClientApp, ServerApp loop)."""

import json
from pathlib import Path

import pytest

from fedsparse.client.app import app as client_app
from fedsparse.common.config import FederatedConfig
from fedsparse.common.wire.run_log import read_rounds
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.app import run_federated


@pytest.mark.parametrize(
    ("codec", "value_dtype", "rate", "bits"),
    [("values", "int8", 0.9, 0.8), ("values", "fp32", 0.0, 32.0), ("coo", "fp32", 0.9, 6.4)],
)
def test_records_carry_the_payloads_bits_per_parameter(
    tmp_path: Path, codec: str, value_dtype: str, rate: float, bits: float
) -> None:
    """values-only int8 at r = 0.9 is 0.8 bits/param plus its header; dense fp32 is 32 plus
    its header; explicit 32-bit indices (coo) add 3.2 bits at r = 0.9."""
    cfg = FederatedConfig(
        out_dir=str(tmp_path), num_rounds=1, final_rate=rate, schedule="constant",
        codec=codec, value_dtype=value_dtype, noise_multiplier=1.0, target_epsilon=0.0,
    )  # fmt: skip
    run_federated(InProcessGrid(client_app, num_nodes=2, run_config=cfg.to_run_config()), cfg)
    (entry,) = read_rounds(tmp_path / "rounds.jsonl")
    summary = json.loads((tmp_path / "summary.json").read_text())
    d = summary["parameters"]
    header_bits = 32 * entry.uplink_payload_bytes / entry.dense_uplink_bytes - bits
    assert 0 <= header_bits < 8 * 64 / d  # a fixed header under 64 bytes per client
    assert summary["uplink_bits_per_param"] == pytest.approx(entry.uplink_bits_per_param)
    assert entry.uplink_bits_per_param == pytest.approx(
        8 * entry.uplink_payload_bytes / (entry.num_replies * d)
    )
