"""End to end on Flower's simulation engine (Ray backend) vs the in-process loop."""

import json
from pathlib import Path

import pytest

from fedsparse.client.app import app as client_app
from fedsparse.common.config import FederatedConfig
from fedsparse.common.masks import keep_count
from fedsparse.common.wire.payload import payload_size
from fedsparse.common.wire.protocol import round_seed
from fedsparse.lab.launch.simulate import run_simulation
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.app import run_federated

D_DIGITS = 38_282
KEYS = (
    "keep",
    "num_replies",
    "uplink_payload_bytes",
    "downlink_payload_bytes",
    "uplink_message_bytes",
    "dense_uplink_bytes",
)


@pytest.mark.slow
def test_simulation_matches_in_process_rounds(tmp_path: Path) -> None:
    overrides = {"num-rounds": "2", "final-rate": "0.5", "target-epsilon": "3.0"}
    summary = run_simulation(out=tmp_path / "sim", overrides=overrides, clients=4)
    sim = [json.loads(x) for x in (tmp_path / "sim" / "rounds.jsonl").read_text().splitlines()]
    assert len(sim) == 2 and summary.rounds == 2
    assert sim[-1]["test_accuracy"] > 0.3  # chance is 0.1
    assert 0 < summary.epsilon_max <= 3.0 + 1e-6
    for r in sim:
        keep = keep_count(D_DIGITS, rate=r["rate"])
        encoding = "dense" if keep == D_DIGITS else "seeded"
        one = payload_size(
            keep=keep,
            dense_size=D_DIGITS,
            round=r["round"],
            encoding=encoding,
            value_dtype="fp32",
            mask_seed=0 if encoding == "dense" else round_seed(0, r["round"]),
        )
        assert r["uplink_payload_bytes"] == 4 * one

    cfg = FederatedConfig.from_run_config({**overrides, "out-dir": str(tmp_path / "inproc")})
    run_federated(InProcessGrid(client_app, num_nodes=4, run_config=cfg.to_run_config()), cfg)
    local = [json.loads(x) for x in (tmp_path / "inproc" / "rounds.jsonl").read_text().splitlines()]
    for a, b in zip(sim, local, strict=True):
        for key in KEYS[:4]:
            assert a[key] == b[key], key
        # Message framing carries node ids and message ids, which differ between runtimes.
        assert (
            abs(a["uplink_message_bytes"] - b["uplink_message_bytes"])
            < 0.01 * a["uplink_message_bytes"]
        )
        assert a["epsilon_max"] == pytest.approx(b["epsilon_max"], rel=1e-9)
