"""Benchmark: bytes per update against the information limit, per codec, three layers deep.

For the DP-CNN (d = 550,570) and the digits CNN (d = 38,282), at sparsification rates
r in {0, 0.5, 0.7, 0.9}, for each support codec (values-only with the seed-shared mask, COO
int32, delta varints, bitmap, auto) and value encoding, prints:

* payload / limit: the encoded ``SparseUpdate`` over the information limit
  ``(1 - r) d x value bytes`` (``payload.information_limit``);
* message / payload: a Flower ``Message`` carrying the payload as the ClientApp replies
  (``server.app.message_bytes``: the serialized objects Flower ships) over the payload;
* wire / payload (``--wire``, on by default): bytes that crossed TCP between each SuperNode and
  the SuperLink during the round, counted by a byte relay in a real loopback deployment
  (``server.launch.run_deployment``; gRPC/HTTP2 framing, the object protocol's RPCs and the
  SuperNodes' polling included; TLS with ``--tls``). Reported raw and with the idle polling
  estimate (idle rate x round time, measured before the run) taken out. One deployment per
  (model, codec) runs 5 rounds with rates 0, 0, 0.5, 0.7, 0.9: round 1 is a warm-up (the app
  bundle download and the first dense model), rounds 2-5 give the four rates.

Targets checked: values-only payload <= limit + 64 B; message <= 1.02 x payload for
d >= 10^5. The DP-CNN runs on a small synthetic CIFAR-10 written in the standard pickle
format (bytes do not depend on pixel values). Values are Gaussian, like a DP-noised update.

Usage: python benchmarks/bytes.py [--no-wire] [--tls] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from fedsparse.common.masks import derive_seed, keep_count
from fedsparse.common.models.classifiers import build_model, count_parameters
from fedsparse.common.wire.payload import decode_update, encode_update, information_limit
from fedsparse.common.wire.protocol import CONFIG_RECORD, METRICS_RECORD, TrainReply
from fedsparse.server.messages import message_bytes

RATES = (0.0, 0.5, 0.7, 0.9)
CODECS = ("values", "coo", "delta", "bitmap", "auto")
WIRE_CODECS = ("values", "coo", "delta", "bitmap")
MODELS = {"dpcnn": "cifar10", "digits-cnn": "digits"}
ENCODING = {"values": "seeded", "coo": "coo", "delta": "delta", "bitmap": "bitmap"}


def encode(values: torch.Tensor, d: int, keep: int, seed: int, codec: str, **kwargs: Any) -> bytes:
    """The client's uplink encoding for ``codec`` (full updates travel dense for every codec)."""
    if keep == d:
        return encode_update(values, dense_size=d, round=7, **kwargs)
    encoding = {"auto": "auto"}.get(codec, ENCODING.get(codec, codec))
    return encode_update(values, dense_size=d, round=7, mask_seed=seed, encoding=encoding, **kwargs)


NODE_ID = 0x5E6F_1A2B_3C4D_7E8F  # Flower's ids are random 64-bit: full-length varints


def reply_message(payload: bytes) -> Message:
    """A Flower message shaped like the ClientApp's train reply."""
    for attr, value in (("run_id", 0x7A3C_9E21_44D0_1B55), ("task_id", 1), ("node_id", 1)):
        try:
            getattr(TaskIdentity, attr)
        except RuntimeError:  # not inside a Flower runtime: stamp like one
            setattr(TaskIdentity, attr, SUPERLINK_NODE_ID if attr == "node_id" else value)
    reply = TrainReply(
        update=payload,
        num_examples=898,
        examples_seen=898,
        train_loss=0.5,
        epsilon=2.9,
        noise_multiplier=1.1,
        keep=1,
    )
    config, metrics = reply.to_records()
    content = RecordDict(
        {CONFIG_RECORD: ConfigRecord(config), METRICS_RECORD: MetricRecord(metrics)}
    )
    return Message(content=content, dst_node_id=NODE_ID, message_type=MessageType.TRAIN)


def payload_table(model: str) -> list[dict[str, Any]]:
    d = count_parameters(build_model(model, seed=0))
    seed = derive_seed(2024, 7)
    rows = []
    gen = torch.Generator().manual_seed(0)
    print(f"\n{model}: d = {d:,}")
    print(
        f"{'r':>4} {'codec':>7} {'values':>6} {'zstd':>4} {'encoding':>8} {'payload B':>11} "
        f"{'limit B':>11} {'payload/limit':>13} {'over limit B':>12} {'message/payload':>15}"
    )
    variants = [(c, "fp32", "none") for c in CODECS]
    variants += [("values", dt, comp) for dt in ("fp16", "bf16", "int8") for comp in ("none",)]
    variants += [("values", dt, "zstd") for dt in ("fp32", "int8")]
    for rate in RATES:
        keep = keep_count(d, rate=rate)
        values = torch.randn(keep, generator=gen) * 0.01
        for codec, dtype, comp in variants:
            payload = encode(values, d, keep, seed, codec, value_dtype=dtype, compression=comp)
            limit = information_limit(keep=keep, value_dtype=dtype)
            message = message_bytes(reply_message(payload))
            row = {
                "model": model,
                "d": d,
                "rate": rate,
                "codec": codec,
                "value_dtype": dtype,
                "compression": comp,
                "encoding": decode_update(payload).encoding,
                "payload_bytes": len(payload),
                "limit_bytes": limit,
                "payload_vs_limit": len(payload) / limit,
                "message_bytes": message,
                "message_vs_payload": message / len(payload),
            }
            rows.append(row)
            print(
                f"{rate:>4} {codec:>7} {dtype:>6} {comp:>4} {row['encoding']:>8} "
                f"{len(payload):>11,} {limit:>11,} {row['payload_vs_limit']:>13.4f} "
                f"{len(payload) - limit:>12,} {row['message_vs_payload']:>15.5f}"
            )
    return rows


def check_targets(rows: list[dict[str, Any]]) -> bool:
    ok = True
    values_only = [r for r in rows if r["encoding"] in ("seeded", "dense")]
    worst = max(r["payload_bytes"] - r["limit_bytes"] for r in values_only if not _zstd(r))
    print(f"\nvalues-only payload - limit: max {worst} B (target <= 64 B)")
    ok &= worst <= 64
    big = [r for r in rows if r["d"] >= 10**5]
    worst_ratio = max(r["message_vs_payload"] for r in big)
    print(f"message / payload for d >= 1e5: max {worst_ratio:.5f} (target <= 1.02)")
    ok &= worst_ratio <= 1.02
    return ok


def _zstd(row: dict[str, Any]) -> bool:
    return row["compression"] == "zstd"


def write_synthetic_cifar(root: Path, per_batch: int = 64, test: int = 100) -> Path:
    """CIFAR-10's python pickles with random pixels (what ``load_dataset('cifar10')`` reads)."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for name, n in [*((f"data_batch_{i}", per_batch) for i in range(1, 6)), ("test_batch", test)]:
        batch = {
            b"batch_label": name.encode(),
            b"labels": rng.integers(0, 10, n).tolist(),
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"filenames": [b"%d.png" % i for i in range(n)],
        }
        (root / name).write_bytes(pickle.dumps(batch, protocol=2))
    return root


def wire_table(model: str, work: Path, *, tls: bool) -> list[dict[str, Any]]:
    from fedsparse.lab.launch.deploy import run_deployment
    from fedsparse.lab.launch.wire import wire_report

    dataset = MODELS[model]
    base: dict[str, Any] = {
        "num-rounds": 5,
        "schedule": "steps",
        "rate-steps": "0,0,0.5,0.7,0.9",
        "min-clients": 2,
        "dataset": dataset,
        "model": model,
        "local-epochs": 1,
    }
    if dataset == "cifar10":
        base["data-dir"] = str(write_synthetic_cifar(work / "cifar10"))
    rows = []
    print(
        f"\n{model} on a loopback deployment (2 SuperNodes{', TLS' if tls else ''}): "
        "per round, both nodes together"
    )
    print(
        f"{'r':>4} {'codec':>7} {'up payload B':>12} {'up wire B':>11} {'wire/payload':>12} "
        f"{'(-idle)':>8} {'down payload B':>14} {'down wire B':>11} {'wire/payload':>12} "
        f"{'(-idle)':>8} {'s':>5}"
    )
    for codec in WIRE_CODECS:
        out = work / f"{model}-{codec}"
        start = time.monotonic()
        run_deployment(
            out=out,
            overrides={**base, "codec": codec},
            num_nodes=2,
            timeout=900,
            idle_seconds=6.0,
            tls=tls,
        )
        elapsed = time.monotonic() - start
        for entry in wire_report(out)[1:]:  # round 1: app bundle download + dense model
            rate = RATES[entry["round"] - 2]
            row = {"model": model, "codec": codec, "rate": rate, "tls": tls, **entry}
            for link in ("uplink", "downlink"):
                payload = entry[f"{link}_payload_bytes"]
                wire = entry[f"{link}_wire_bytes"]
                idle = entry[f"{link}_idle_estimate_bytes"] or 0
                row[f"{link}_wire_vs_payload"] = wire / payload
                row[f"{link}_wire_less_idle_vs_payload"] = (wire - idle) / payload
            rows.append(row)
            print(
                f"{rate:>4} {codec:>7} {entry['uplink_payload_bytes']:>12,} "
                f"{entry['uplink_wire_bytes']:>11,} {row['uplink_wire_vs_payload']:>12.4f} "
                f"{row['uplink_wire_less_idle_vs_payload']:>8.4f} "
                f"{entry['downlink_payload_bytes']:>14,} {entry['downlink_wire_bytes']:>11,} "
                f"{row['downlink_wire_vs_payload']:>12.4f} "
                f"{row['downlink_wire_less_idle_vs_payload']:>8.4f} {entry['seconds']:>5.1f}"
            )
        print(f"   ({codec}: deployment took {elapsed:.0f} s)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--no-wire", action="store_true", help="skip the loopback deployments")
    parser.add_argument("--tls", action="store_true", help="run the deployments with TLS")
    parser.add_argument("--models", default="dpcnn,digits-cnn", help="comma-separated models")
    parser.add_argument("--json", type=Path, help="also write every row here")
    args = parser.parse_args()
    torch.set_num_threads(2)
    models = [m for m in args.models.split(",") if m]
    results: dict[str, Any] = {"payload": [], "wire": []}
    for model in models:
        results["payload"] += payload_table(model)
    ok = check_targets(results["payload"])
    if not args.no_wire:
        with tempfile.TemporaryDirectory(prefix="fedsparse-bytes-") as tmp:
            for model in models:
                results["wire"] += wire_table(model, Path(tmp), tls=args.tls)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print("\ntargets:", "met" if ok else "MISSED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
