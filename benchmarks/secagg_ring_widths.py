"""What a small ring's width costs in noise: the exact ring against ``secagg-ring-bits`` = 10 to
16 at 100 and 1,000 clients (issue "Secure aggregation at a thousand clients a round").

Pure arithmetic on the public parameters (``common/aggregation/secure.py``, ``small_ring.py``),
no round is run: for ``--kept`` values a client (3,829: the digits CNN at r = 0.9, of its
38,282 parameters), 5% colluders and the smallest threshold, and each central target ``z``
of ``--targets`` (1, and 8.18: user epsilon 3 over 30 rounds of every client), each row gives
the masked payload per client (bytes, bits per parameter; the exact ring sends whole bytes),
the ``sigma`` the target needs over the target (``ring_for_central``: the rounding bound and,
in a small ring, the sum's divergence from one discrete Gaussian charged), the rounding's
share of the sensitivity (``Delta / sC``), and the decoded sum's noise in value units over
``z C``: what the width costs in accuracy at the same epsilon (1: none).

Usage: python benchmarks/secagg_ring_widths.py [--clients 100 1000] [--kept 3829]
"""

from __future__ import annotations

import argparse
import math

from fedsparse.common.aggregation.secure import (
    ring_for_central,
    smallest_threshold,
)

PARAMETERS = 38_282
"""The digits CNN's parameters (``common/models``): bits per parameter are per these."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--kept", type=int, default=3829)
    parser.add_argument("--targets", type=float, nargs="+", default=[1.0, 8.18])
    args = parser.parse_args()
    head = f"{'n':>5} {'ring':>10} {'bytes':>7} {'bits/param':>10}"
    for target in args.targets:
        head += f" | z={target:g}: {'sigma/z':>7} {'Delta/sC':>8} {'noise/zC':>8}"
    print(head)
    for n in args.clients:
        colluders = n // 20
        ring = dict(
            clip=1.0,
            clients=n,
            threshold=smallest_threshold(n, colluders),
            kept=args.kept,
            colluders=colluders,
        )
        for bits in (0, 16, 14, 13, 12, 11, 10):
            name = f"{bits} bits"
            row = ""
            try:
                for target in args.targets:
                    p = ring_for_central(target, bits=bits, **ring)  # type: ignore[arg-type]
                    # the decoded sum's noise at the threshold, in value units, over z C
                    noise = p.share_std * math.sqrt(p.threshold - p.colluders) / p.scale
                    inflation = p.sensitivity / (p.scale * p.clip)
                    row += f" | {'':>{len(f'z={target:g}:')}} {p.sigma / target:>7.3f}"
                    row += f" {inflation:>8.3f} {noise / (target * p.clip):>8.3f}"
            except ValueError as exc:
                print(f"{n:>5} {name:>10}  refused: {exc}")
                continue
            name = name if bits else f"exact {p.bits}"
            per_param = 8 * p.input_bytes / PARAMETERS
            print(f"{n:>5} {name:>10} {p.input_bytes:>7,} {per_param:>10.3f}{row}")


if __name__ == "__main__":
    main()
