"""``downlink-dtype=int4`` end to end: the real ClientApp in process, clients sampled each round.

After every round each node that trained holds the server's global model of that round bit for
bit (``torch.equal``), whether it was new, one version behind (it added the int4 change) or
further behind (exact values); the records carry downlink bits per parameter beside uplink.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message

from fedsparse.client.app import app as client_app
from fedsparse.common.config import FederatedConfig
from fedsparse.common.layout import ParamLayout
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.wire.payload import payload_size
from fedsparse.common.wire.protocol import (
    CONFIG_RECORD,
    DOWNLINK_KIND,
    STATE_MODEL,
    STATE_RECORD,
    TrainInstruction,
    round_seed,
)
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.app import run_federated
from fedsparse.server.strategy import SparseFedAvg, flat_array, flat_tensor

pytestmark = pytest.mark.slow

NODES = 4


def test_every_node_holds_the_servers_model_after_each_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = FederatedConfig(
        num_rounds=6,
        clients_per_round=2,  # nodes skip rounds: some come back two or more versions behind
        target_epsilon=0.0,
        noise_multiplier=0.5,
        final_rate=0.7,  # gradual: round 1 dense, so round 2's change is dense too
        downlink_dtype="int4",
        seed=3,
        out_dir=str(tmp_path),
    )
    server: dict[int, torch.Tensor] = {}  # version -> the server's global model
    configure = SparseFedAvg.configure_train

    def recording_configure(self, server_round, arrays, config, grid):  # type: ignore[no-untyped-def]
        server[server_round - 1] = flat_tensor(arrays)
        return configure(self, server_round, arrays, config, grid)

    monkeypatch.setattr(SparseFedAvg, "configure_train", recording_configure)
    held: dict[int, int] = {}
    deltas: list[tuple[int, int]] = []  # (version, payload bytes)
    copies: list[tuple[int, int, str, str, torch.Tensor]] = []

    def recording_client(msg: Message, context: Context) -> Message:
        record = msg.content.config_records[CONFIG_RECORD]
        task = TrainInstruction.from_record(record)
        node = context.node_id
        before = held.get(node)
        gap = "new" if before is None else f"{min(task.model_version - before, 2)} behind"
        reply = client_app(msg, context)
        assert not reply.has_error(), reply.error.reason
        version = context.state.config_records[STATE_RECORD]["version"]
        assert version == task.model_version
        stored = context.state.config_records[STATE_RECORD][STATE_MODEL]  # float32 LE bytes
        assert isinstance(stored, bytes)
        flat = torch.frombuffer(bytearray(stored), dtype=torch.float32)
        kind = str(record.get(DOWNLINK_KIND, "values"))
        copies.append((node, task.model_version, kind, gap, flat))
        if kind == "delta":
            deltas.append((task.model_version, len(task.model)))
        held[node] = task.model_version
        return reply

    grid = InProcessGrid(recording_client, num_nodes=NODES, run_config=cfg.to_run_config())
    run_federated(grid, cfg)
    d = _numel(cfg)
    cases = set()
    for node, version, kind, gap, flat in copies:
        assert torch.equal(flat, server[version]), (node, version, kind, gap)
        cases.add(f"{kind}, {gap}")
    assert {"values, new", "delta, 1 behind", "values, 2 behind"} <= cases, cases
    # The final model is the last version plus its decoded change (the checkpoint's).
    final = torch.load(tmp_path / "checkpoint.pt")["weights"]
    assert not torch.equal(final, server[cfg.num_rounds - 1])
    lines = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    for line in lines:
        bits = 32 * line["downlink_payload_bytes"] / line["dense_downlink_bytes"]
        assert line["downlink_bits_per_param"] == pytest.approx(bits)
    # Each change costs what the int4 codec says for its round's support (seeded mask, or
    # dense in round 1): about keep / 2 bytes and a float32 step per 256 values.
    versions = {version for version, _ in deltas}
    assert 1 in versions and len(versions) > 1, versions  # a dense change and sparse ones
    for version, size in deltas:
        keep = lines[version - 1]["keep"]
        sparse = keep < d
        expected = payload_size(
            keep=keep,
            dense_size=d,
            round=version + 1,
            encoding="seeded" if sparse else "dense",
            mask_seed=round_seed(cfg.seed, version) if sparse else 0,
            value_dtype="int4",
        )
        assert size == expected
        assert keep / 2 + 4 * math.ceil(keep / 256) < size < keep / 2 + 4 * keep / 256 + 40
    summary: dict[str, Any] = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["downlink-dtype"] == "int4"
    total = 32 * summary["total_downlink_payload_bytes"] / summary["total_dense_downlink_bytes"]
    assert summary["downlink_bits_per_param"] == pytest.approx(total)
    # Round 1 sends the dense model to new nodes (32 bits and a header); later rounds less.
    assert lines[0]["downlink_bits_per_param"] > 32
    assert min(line["downlink_bits_per_param"] for line in lines[1:]) < 16


def test_an_unknown_downlink_kind_is_a_client_error_naming_it(tmp_path: Path) -> None:
    cfg = FederatedConfig(num_rounds=1, target_epsilon=0.0, noise_multiplier=0.5)
    grid = InProcessGrid(client_app, num_nodes=2, run_config=cfg.to_run_config())
    strategy = SparseFedAvg(cfg, num_parameters=_numel(cfg))
    arrays = _initial(cfg)
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    for message in messages:
        message.content.config_records[CONFIG_RECORD][DOWNLINK_KIND] = "patch"
    replies = list(grid.send_and_receive(messages))
    assert replies and all(r.has_error() for r in replies)
    for reply in replies:
        assert "downlink-kind='patch': expected one of values, delta" in reply.error.reason


def _numel(cfg: FederatedConfig) -> int:
    return ParamLayout.from_module(build_model(cfg.model_name, seed=cfg.seed)).numel


def _initial(cfg: FederatedConfig) -> ArrayRecord:
    model = build_model(cfg.model_name, seed=cfg.seed)
    return flat_array(ParamLayout.from_module(model).flatten_module(model))
