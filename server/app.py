"""fedsparse ServerApp: seed-shared sparse masks, sparse-aware FedAvg, byte and privacy accounting.

Flower's stock strategies and DP wrappers assume one dense ``ArrayRecord`` per message, so the
round loop is this app's own ``@app.main``. Each round it: computes the round's rate from the
schedule, draws the round's mask seed, samples clients, sends each one the global model
(dense on first contact, else only the values it is missing) plus the round config, validates
every reply at the trust boundary (a bad reply is logged and dropped, the rest aggregate),
applies sparse-aware FedAvg, evaluates on the held-out test set, and appends one JSON line
to ``<out-dir>/rounds.jsonl`` with bytes (payload, Flower message, dense baseline) and epsilon.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from fedsparse.client.app import model_name
from fedsparse.common.aggregate import SparseAggregator
from fedsparse.common.config import FederatedConfig, wire_encoding
from fedsparse.common.data import load_dataset
from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import derive_seed, keep_count, sample_mask
from fedsparse.common.models import DEFAULT_MODELS, build_model
from fedsparse.common.payload import (
    ENCODINGS,
    EXPLICIT_ENCODINGS,
    PayloadError,
    decode_update,
    encode_update,
)
from fedsparse.common.protocol import CONFIG_RECORD, METRICS_RECORD, client_mask_seed, round_seed
from fedsparse.common.training import evaluate

__all__ = ["DEFAULT_MODELS", "app", "message_bytes", "run_federated"]

app = ServerApp()


def message_bytes(message: Message) -> int:
    """Serialized size of a Flower message: the sum of its content-addressed objects.

    Flower ships a message as separate objects (message, records, arrays, chunks); this is what
    crosses the Fleet API for its content, before gRPC/HTTP/TCP framing.
    """
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())


@dataclass
class _Downlink:
    """What the server knows about which global model version each node holds.

    Downloads carry global-model VALUES in fp32 (never quantized: the global model is not a
    noisy update) with the run's codec and compression for the support.
    """

    codec: str = "values"
    compression: str = "none"
    versions: dict[int, int] = field(default_factory=dict)
    touched: dict[int, torch.Tensor] = field(default_factory=dict)  # version -> changed coords
    seeded: dict[int, tuple[int, int]] = field(default_factory=dict)  # version -> (seed, keep)

    def payload(
        self, node: int, weights: torch.Tensor, *, version: int, server_round: int
    ) -> tuple[bytes, int]:
        """(payload of global-model VALUES the node is missing, base version it patches)."""
        d = weights.numel()
        dense = encode_update(
            weights, dense_size=d, round=server_round, compression=self.compression
        )
        held = self.versions.get(node)
        if held is None or any(v not in self.touched for v in range(held + 1, version + 1)):
            return dense, -1
        if held + 1 == version and version in self.seeded:
            seed, keep = self.seeded[version]
            mask = sample_mask(d, keep=keep, seed=seed)
            return encode_update(
                weights[mask],
                dense_size=d,
                round=server_round,
                mask_seed=seed,
                encoding=wire_encoding(self.codec, sparse=True),
                compression=self.compression,
            ), held
        union = torch.zeros(d, dtype=torch.bool)
        for v in range(held + 1, version + 1):
            union |= self.touched[v]
        support = torch.nonzero(union).flatten()
        sparse = encode_update(
            weights[support],
            dense_size=d,
            round=server_round,
            indices=support,
            encoding="auto",  # a data-dependent union: no seed, smallest explicit support
            compression=self.compression,
        )
        return (sparse, held) if len(sparse) < len(dense) else (dense, -1)


@dataclass
class RoundLog:
    """One line of ``rounds.jsonl``."""

    round: int
    num_clients: int
    num_replies: int
    num_rejected: int
    rate: float
    keep: int
    keep_fraction: float
    test_accuracy: float
    test_loss: float
    epsilon_max: float
    epsilon_median: float
    train_loss: float
    uplink_payload_bytes: int
    uplink_message_bytes: int
    downlink_payload_bytes: int
    downlink_message_bytes: int
    dense_uplink_bytes: int
    dense_downlink_bytes: int
    wall_seconds: float
    started_at: float  # unix time the round began (to match wire captures by time)
    ended_at: float  # unix time the round's line was written
    rejected: list[str]


def _wait_for_nodes(grid: Grid, minimum: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= minimum:
            return nodes
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"min-clients={minimum}: only {len(nodes)} nodes connected after {timeout:.0f} s"
            )
        time.sleep(1.0)


def _train_config(
    cfg: FederatedConfig,
    server_round: int,
    seed: int,
    keep: int,
    payload: bytes,
    base_version: int,
    version: int,
) -> ConfigRecord:
    return ConfigRecord(
        {
            "round": server_round,
            "num-rounds": cfg.num_rounds,
            "mask-seed": seed,
            "keep": keep,
            "mask-scope": cfg.mask_scope,
            "local-epochs": cfg.local_epochs,
            "batch-size": cfg.batch_size,
            "lr": cfg.lr,
            "momentum": cfg.momentum,
            "base-version": base_version,
            "model-version": version,
            "model": payload,
        }
    )


def _accepted_encodings(codec: str, *, sparse: bool) -> tuple[str, ...]:
    """Encodings a reply may use: the configured one (any sparse one for ``auto``)."""
    encoding = wire_encoding(codec, sparse=sparse)
    if encoding == "auto":
        return tuple(e for e in ENCODINGS if e != "dense")
    return (encoding,)


def _check_reply(
    reply: Message,
    *,
    d: int,
    server_round: int,
    expected_seed: int | None,
    keep: int,
    codec: str = "values",
) -> tuple[torch.Tensor, torch.Tensor | None, float, dict[str, Any], int]:
    """Validates one reply; returns (values, support or None, weight, metrics, payload size).

    An explicit support (coo/delta/bitmap) must equal the round's public mask: the server
    never aggregates values on coordinates a client chose itself.
    """
    try:
        payload = bytes(reply.content.config_records[CONFIG_RECORD]["update"])
        metrics = dict(reply.content.metric_records[METRICS_RECORD])
    except (KeyError, TypeError) as err:
        raise PayloadError(f"reply content: missing record or key {err}") from None
    update = decode_update(
        payload,
        expected_dense_size=d,
        expected_round=server_round,
        expected_mask_seed=expected_seed,
        expected_encoding=_accepted_encodings(codec, sparse=keep < d),
        expected_keep=keep,
    )
    if update.encoding in EXPLICIT_ENCODINGS:
        assert expected_seed is not None  # keep < d
        mask = sample_mask(d, keep=keep, seed=expected_seed)
        if not torch.equal(update.support(), torch.nonzero(mask).flatten()):
            raise PayloadError(f"indices: the {update.encoding} support is not the round's mask")
    weight = metrics.get("num-examples")
    if not isinstance(weight, int) or not 0 < weight <= 10**9:
        raise PayloadError(f"num-examples={weight!r}: expected an integer in [1, 1e9]")
    return update.values, update.support(), float(weight), metrics, len(payload)


def run_federated(grid: Grid, cfg: FederatedConfig) -> dict[str, Any]:
    """The round loop; returns the run summary (also written to ``summary.json``)."""
    torch.set_num_threads(1)
    out = Path(cfg.out_dir or "runs/latest")
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(model_name(cfg), seed=cfg.seed)
    layout = ParamLayout.from_module(model)
    d = layout.numel
    weights = layout.flatten_module(model).clone()
    _, test = load_dataset(cfg.dataset, data_dir=cfg.data_dir or None, seed=cfg.seed)
    schedule = cfg.sparsity().rate_schedule(cfg.num_rounds)
    downlink = _Downlink(codec=cfg.codec, compression=cfg.compression)
    rng = np.random.default_rng(derive_seed(cfg.seed, 0xC0FFEE))
    epsilons: dict[int, float] = {}
    logs: list[RoundLog] = []
    (out / "rounds.jsonl").write_text("")
    log(
        INFO,
        "fedsparse: %s, model %s (d=%d), %d rounds",
        cfg.dataset,
        model_name(cfg),
        d,
        cfg.num_rounds,
    )
    nodes = _wait_for_nodes(grid, cfg.min_clients, cfg.round_timeout)
    for server_round in range(1, cfg.num_rounds + 1):
        started, started_at = time.perf_counter(), time.time()
        rate = schedule.rate(server_round - 1)
        keep = keep_count(d, rate=rate)
        seed = round_seed(cfg.seed, server_round)
        nodes = sorted(grid.get_node_ids())
        count = min(cfg.clients_per_round or len(nodes), len(nodes))
        # Sample positions, not ids: numpy would turn 64-bit node ids into floats.
        selected = sorted(nodes[int(i)] for i in rng.choice(len(nodes), size=count, replace=False))
        version = server_round - 1
        messages, down_payload, down_message = [], 0, 0
        for node in selected:
            payload, base = downlink.payload(
                node, weights, version=version, server_round=server_round
            )
            msg = Message(
                content=RecordDict(
                    {
                        CONFIG_RECORD: _train_config(
                            cfg, server_round, seed, keep, payload, base, version
                        )
                    }
                ),
                dst_node_id=node,
                message_type=MessageType.TRAIN,
                group_id=str(server_round),
            )
            messages.append(msg)
            down_payload += len(payload)
            down_message += message_bytes(msg)
        replies = list(grid.send_and_receive(messages, timeout=cfg.round_timeout))

        aggregator = SparseAggregator(d)
        rejected: list[str] = []
        up_payload = up_message = answered = 0
        losses: list[tuple[float, float]] = []
        for reply in replies:
            node = int(reply.metadata.src_node_id)
            if reply.has_error():
                downlink.versions.pop(node, None)  # unknown state: dense next time
                rejected.append(f"node {node}: client error: {reply.error.reason}")
                continue
            downlink.versions[node] = version  # it applied this round's downlink
            answered += 1
            up_message += message_bytes(reply)
            expected_seed = seed if cfg.mask_scope == "round" else client_mask_seed(seed, node)
            try:
                values, support, weight, metrics, size = _check_reply(
                    reply,
                    d=d,
                    server_round=server_round,
                    expected_seed=None if keep == d else expected_seed,
                    keep=keep,
                    codec=cfg.codec,
                )
                aggregator.add(values, support=support, weight=weight)
            except (PayloadError, ValueError) as err:
                rejected.append(f"node {node}: {err}")
                continue
            up_payload += size
            losses.append((float(metrics.get("train-loss", math.nan)), weight))
            eps = float(metrics.get("epsilon", -1.0))
            epsilons[node] = math.inf if eps < 0 else eps
        for reason in rejected:
            log(WARNING, "round %d: dropped %s", server_round, reason)

        touched = (
            aggregator.apply_(weights)
            if aggregator.num_updates
            else torch.zeros(d, dtype=torch.bool)
        )
        downlink.touched[server_round] = touched
        if cfg.mask_scope == "round" and keep < d and aggregator.num_updates:
            downlink.seeded[server_round] = (seed, keep)
        layout.load_flat_(model, weights)
        test_loss, test_acc = evaluate(model, test.x, test.y)
        eps_values = list(epsilons.values()) or [0.0]
        total_w = sum(w for _, w in losses)
        entry = RoundLog(
            round=server_round,
            num_clients=len(selected),
            num_replies=len(replies),
            num_rejected=len(rejected),
            rate=rate,
            keep=keep,
            keep_fraction=keep / d,
            test_accuracy=test_acc,
            test_loss=test_loss,
            epsilon_max=max(eps_values),
            epsilon_median=float(statistics.median(eps_values)),
            train_loss=sum(loss * w for loss, w in losses) / total_w if total_w else math.nan,
            uplink_payload_bytes=up_payload,
            uplink_message_bytes=up_message,
            downlink_payload_bytes=down_payload,
            downlink_message_bytes=down_message,
            dense_uplink_bytes=answered * d * 4,
            dense_downlink_bytes=len(selected) * d * 4,
            wall_seconds=time.perf_counter() - started,
            started_at=started_at,
            ended_at=time.time(),
            rejected=rejected,
        )
        logs.append(entry)
        with (out / "rounds.jsonl").open("a") as fh:
            fh.write(json.dumps(dataclasses.asdict(entry)) + "\n")
        _checkpoint(out, server_round, weights, layout, cfg)
        log(
            INFO,
            "round %d: r=%.3f acc=%.4f eps_max=%.3f up=%d B (dense %d B) rejected=%d",
            server_round,
            rate,
            test_acc,
            entry.epsilon_max,
            up_payload,
            entry.dense_uplink_bytes,
            len(rejected),
        )
    summary = _summary(logs, cfg, d)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _checkpoint(
    out: Path, server_round: int, weights: torch.Tensor, layout: ParamLayout, cfg: FederatedConfig
) -> None:
    tmp = out / "checkpoint.pt.tmp"
    torch.save(
        {
            "round": server_round,
            "weights": weights.clone(),
            "names": layout.names,
            "shapes": layout.shapes,
            "config": cfg.to_run_config(),
        },
        tmp,
    )
    tmp.replace(out / "checkpoint.pt")


def _summary(logs: list[RoundLog], cfg: FederatedConfig, d: int) -> dict[str, Any]:
    def total(key: str) -> int:
        return int(sum(getattr(entry, key) for entry in logs))

    last = logs[-1]
    up, dense_up = total("uplink_payload_bytes"), total("dense_uplink_bytes")
    return {
        "rounds": len(logs),
        "parameters": d,
        "final_test_accuracy": last.test_accuracy,
        "final_test_loss": last.test_loss,
        "epsilon_max": last.epsilon_max,
        "epsilon_median": last.epsilon_median,
        "delta": cfg.delta,
        **{
            f"total_{k}": total(k)
            for k in (
                "uplink_payload_bytes",
                "uplink_message_bytes",
                "downlink_payload_bytes",
                "downlink_message_bytes",
                "dense_uplink_bytes",
                "dense_downlink_bytes",
            )
        },
        "uplink_savings": dense_up / up if up else math.nan,
        "uplink_message_savings": dense_up / total("uplink_message_bytes") if up else math.nan,
        "rejected_updates": total("num_rejected"),
        "wall_seconds": sum(entry.wall_seconds for entry in logs),
        "config": cfg.to_run_config(),
    }


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point for ``flwr run``: parses the run config and runs the round loop."""
    run_federated(grid, FederatedConfig.from_run_config(context.run_config))
