"""Benchmark: bits per parameter and encode/decode time of every value dtype on a DP-CNN update.

One DP-CNN-sized uplink update (d = 550,570 parameters) at sparsification rate r* = 0.9
(keep = 55,057 values on the seed-shared mask, ``"seeded"`` encoding), with standard normal
values (a DP update is mostly its Gaussian noise). For each value dtype in
``payload.PAYLOAD_DTYPES`` it prints:

* bytes: the serialized payload (header, packed values, and the int4/int2/int1 steps);
* bits/value: payload bits per transmitted value; bits/param: per model parameter;
* encode ms and decode ms: medians over ``--repeats`` runs (the low-bit encoders include the
  stochastic rounding's uniform draws from a seeded ``numpy.random.Generator``);
* rms err: the root mean square of decoded - original, in units of the values' sd (0 for
  fp32; the rounding error of the others).

Then, for the low-bit dtypes, the block-size trade-off behind ``DEFAULT_VALUE_BLOCK``: bits
per value and rms error at blocks of 64 to 4096 values (``--no-blocks`` skips it).

Usage: python benchmarks/codecs.py [--block 256] [--repeats 21] [--no-blocks] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from fedsparse.common.masks import derive_seed, keep_count
from fedsparse.common.wire.payload import (
    DEFAULT_VALUE_BLOCK,
    LOWBIT_DTYPES,
    PAYLOAD_DTYPES,
    decode_update,
    encode_update,
)

DENSE_SIZE = 550_570  # the DP-CNN's trainable parameters
RATE = 0.9
BLOCKS = (64, 128, 256, 512, 1024, 4096)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(value_dtype: str, *, block: int, repeats: int) -> dict[str, float | int | str]:
    keep = keep_count(DENSE_SIZE, rate=RATE)
    values = torch.randn(keep, generator=torch.Generator().manual_seed(0))
    seed = derive_seed(2024, 5)
    rounding = np.random.default_rng(1)

    def encode() -> bytes:
        return encode_update(
            values,
            dense_size=DENSE_SIZE,
            round=5,
            mask_seed=seed,
            value_dtype=value_dtype,  # type: ignore[arg-type]
            value_block=block,
            rounding=rounding,
        )

    payload = encode()
    decoded = decode_update(payload, expected_dense_size=DENSE_SIZE).values
    rms = float((decoded.double() - values.double()).pow(2).mean().sqrt())
    return {
        "value_dtype": value_dtype,
        "bytes": len(payload),
        "bits_per_value": 8 * len(payload) / keep,
        "bits_per_param": 8 * len(payload) / DENSE_SIZE,
        "encode_ms": median_ms(encode, repeats),
        "decode_ms": median_ms(lambda: decode_update(payload), repeats),
        "rms_error_sd": rms / float(values.double().std()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--block", type=int, default=DEFAULT_VALUE_BLOCK, help="value_block")
    parser.add_argument("--repeats", type=int, default=21, help="timed runs per median")
    parser.add_argument("--no-blocks", action="store_true", help="skip the block-size table")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep = keep_count(DENSE_SIZE, rate=RATE)
    print(f"d = {DENSE_SIZE:,}, r* = {RATE}, keep = {keep:,}, value_block = {args.block}")
    print(
        f"{'dtype':>6} {'bytes':>9} {'bits/value':>11} {'bits/param':>11} "
        f"{'encode ms':>10} {'decode ms':>10} {'rms err':>8}"
    )
    rows = []
    for value_dtype in PAYLOAD_DTYPES:
        row = measure(value_dtype, block=args.block, repeats=args.repeats)
        rows.append(row)
        print(
            f"{value_dtype:>6} {row['bytes']:>9,} {row['bits_per_value']:>11.3f} "
            f"{row['bits_per_param']:>11.4f} {row['encode_ms']:>10.2f} "
            f"{row['decode_ms']:>10.2f} {row['rms_error_sd']:>8.4f}"
        )
    if not args.no_blocks:
        print("\nblock size: bits/value (rms err in sd)")
        print(f"{'dtype':>6} " + " ".join(f"{b:>15}" for b in BLOCKS))
        for value_dtype in LOWBIT_DTYPES:
            cells = []
            for block in BLOCKS:
                row = measure(value_dtype, block=block, repeats=1)
                rows.append({**row, "value_block": block})
                cells.append(f"{row['bits_per_value']:>6.3f} ({row['rms_error_sd']:.3f})")
            print(f"{value_dtype:>6} " + " ".join(f"{c:>15}" for c in cells))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
