"""A deployment on rate-limited links: the limit is real and the run says how it was made.

Each SuperNode's uplink is shaped to ``RATE`` bit/s, either by the kernel (its own network
namespace on a ``tbf``-shaped veth pair, ``lab/launch/netns.py``) or, where that is unavailable, by
its byte relay (``relay-fallback``, forced here by monkeypatching the probe). The one round
sends each node's dense update (d = 38,282 fp32 values, ~153 kB on the wire), which at
100 kbit/s takes at least 12 s, several times the round's compute on these 2 cores, so a
round faster than its uplink bytes allow means the link was not shaped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedsparse.common.wire.run_log import read_rounds
from fedsparse.lab.experiments.timing import time_to_accuracy
from fedsparse.lab.launch import deploy
from fedsparse.lab.launch.netns import shaping_unavailable

pytestmark = pytest.mark.slow

RATE = 100_000.0  # bit/s, uplink
RUN_CONFIG = {"num-rounds": 1, "min-clients": 2, "dataset": "digits", "final-rate": 0.0}


@pytest.mark.parametrize("mode", ["tbf", "relay-fallback"])
def test_the_round_takes_at_least_its_uplink_bytes_at_the_rate(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mode == "tbf" and (reason := shaping_unavailable()) is not None:
        pytest.skip(f"kernel shaping unavailable: {reason}")
    if mode == "relay-fallback":
        monkeypatch.setattr(deploy, "shaping_unavailable", lambda: "forced by the test")
    events: list[str] = []
    summary = deploy.run_deployment(
        out=tmp_path,
        overrides=RUN_CONFIG,
        num_nodes=2,
        timeout=300,
        idle_seconds=0,
        uplink_bps=RATE,
        downlink_bps=20 * RATE,
        on_event=events.append,
    )
    wire = json.loads((tmp_path / "wire.json").read_text())
    assert wire["shaping"]["mode"] == mode and wire["shaping"]["uplink_bps"] == RATE
    assert (mode == "relay-fallback") == any("relays shape" in e for e in events)
    [entry] = read_rounds(tmp_path / "rounds.jsonl")
    for node in wire["nodes"]:
        [window] = node["rounds"]
        floor = window["up"] * 8 / RATE  # seconds the node's uplink bytes need at the rate
        assert floor > 10
        assert entry.wall_seconds >= 0.95 * floor, (entry.wall_seconds, floor)
        if mode == "tbf":  # each node dialled its relay on its own namespace's host side
            assert not node["relay"].startswith("127.")
    assert time_to_accuracy(read_rounds(tmp_path / "rounds.jsonl"), 0.0) == entry.wall_seconds
    assert summary.rounds == 1
