"""``method=lf`` and ``method=random-freeze`` federated (ServerApp and ClientApp in process).

Layer freezing: from round ``freeze-after + 1`` on the first ``freeze-layers`` layers move by
exactly 0, each client sends the other ``d - s`` values only (``4 s`` bytes fewer), and a reply
that touches the frozen layers cannot be aggregated.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message

from fedsparse.client.app import app as client_app
from fedsparse.common.config import FederatedConfig
from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import keep_count
from fedsparse.common.methods import frozen_prefix
from fedsparse.common.models import build_model
from fedsparse.common.payload import decode_update, encode_update
from fedsparse.common.protocol import CONFIG_RECORD
from fedsparse.lab.flower import SIMULATION_NODE_POLICY
from fedsparse.lab.inprocess import InProcessGrid
from fedsparse.server.app import run_federated

NODES = 3
#: A fixed sigma: round 1 is then the same whatever num-rounds is.
LF: dict[str, Any] = dict(
    method="lf",
    freeze_layers=1,
    freeze_after=1,
    target_epsilon=0.0,
    noise_multiplier=1.0,
    seed=4,
)


def _run(out: Path, overrides: dict[int, Any] | None = None, **kwargs: Any) -> list[dict]:
    cfg = FederatedConfig(out_dir=str(out), **kwargs)
    grid = InProcessGrid(
        client_app,
        num_nodes=NODES,
        run_config=cfg.to_run_config(),
        node_config=SIMULATION_NODE_POLICY,
        overrides=overrides,
    )
    run_federated(grid, cfg)
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


def _weights(out: Path) -> torch.Tensor:
    return torch.load(out / "checkpoint.pt")["weights"]


def test_frozen_layers_move_by_zero_and_cost_no_uplink_bytes(tmp_path: Path) -> None:
    layout = ParamLayout.from_module(build_model("digits-cnn", seed=4))
    d, s = layout.numel, frozen_prefix(layout, 1)
    initial = layout.flatten_module(build_model("digits-cnn", seed=4))
    _run(tmp_path / "one", num_rounds=1, **LF)
    rounds = _run(tmp_path / "three", num_rounds=3, **LF)
    after_1, after_3 = _weights(tmp_path / "one"), _weights(tmp_path / "three")
    assert not torch.equal(initial[:s], after_1[:s])  # round 1: plain DP-SGD, every layer
    assert torch.equal(after_1[:s], after_3[:s])  # rounds 2 and 3: frozen, bit for bit
    assert not torch.equal(after_1[s:], after_3[s:])
    assert [r["keep"] for r in rounds] == [d, d - s, d - s]
    assert [r["rate"] for r in rounds] == [0.0, s / d, s / d]
    answered = [r["num_accepted"] for r in rounds]
    assert answered == [NODES] * 3
    # The same dense payload, less the frozen layers' 4 s bytes per client.
    up = [r["uplink_payload_bytes"] for r in rounds]
    assert up[1] == up[2] == up[0] - NODES * 4 * s
    summary = json.loads((tmp_path / "three" / "summary.json").read_text())
    assert summary["total_density"] == (d + 2 * (d - s)) / (3 * d)


def _touches_frozen(msg: Message, ctx: Context) -> Message:
    """Trains honestly, then sends all d coordinates, the frozen layers moved by 1."""
    reply = client_app(msg, ctx)
    update = decode_update(bytes(reply.content.config_records[CONFIG_RECORD]["update"]))
    d = update.dense_size + 160
    full = torch.ones(d)
    full[160:] = update.values
    payload = encode_update(full, dense_size=d, round=update.round, encoding="dense")
    reply.content.config_records[CONFIG_RECORD] = ConfigRecord({"update": payload})
    return reply


def test_a_reply_that_moves_a_frozen_layer_is_rejected(tmp_path: Path) -> None:
    layout = ParamLayout.from_module(build_model("digits-cnn", seed=4))
    assert frozen_prefix(layout, 1) == 160  # _touches_frozen's offset
    honest = _run(tmp_path / "honest", num_rounds=2, **{**LF, "freeze_after": 0})
    hostile = _run(
        tmp_path / "hostile", {1001: _touches_frozen}, num_rounds=2, **{**LF, "freeze_after": 0}
    )
    for entry in hostile:
        assert entry["num_accepted"] == NODES - 1 and entry["num_rejected"] == 1
        # d values where d - s are expected: over the payload bound, or of the wrong size
        assert re.match(r"node 1001: payload: .*(exceeds max_bytes|dense)", entry["rejected"][0])
    frozen = _weights(tmp_path / "hostile")[:160]
    assert torch.equal(frozen, layout.flatten_module(build_model("digits-cnn", seed=4))[:160])
    assert honest[0]["num_accepted"] == NODES


def test_random_freeze_runs_the_cooling_schedule_federated(tmp_path: Path) -> None:
    rounds = _run(
        tmp_path / "rf",
        num_rounds=4,
        method="random-freeze",
        final_rate=0.8,
        cooling_rounds=2,
        target_epsilon=0.0,
        noise_multiplier=1.0,
    )
    d = rounds[0]["keep"]
    rates = [0.8 * min(e / 2, 1) for e in range(4)]
    assert [r["rate"] for r in rounds] == rates
    assert [r["keep"] for r in rounds] == [keep_count(d, rate=r) for r in rates]
