"""What a small ring's width costs in noise: the exact ring against ``secagg-ring-bits`` = 10 to
16 at 100 and 1,000 clients (issue "Secure aggregation at a thousand clients a round").

Pure arithmetic on the public parameters (``common/aggregation/secure.py``, ``small_ring.py``),
no round is run: for ``--kept`` values a client (3,829: the digits CNN at r = 0.9, of its
38,282 parameters), 5% colluders and the smallest threshold, each row gives the ring's width,
its scale, the rounding's share of the sensitivity (``Delta / sC``), the central noise
multiplier ``sigma = 1`` carries at the threshold (the rounding bound and, in a small ring,
the sum's divergence from one discrete Gaussian charged), the ``sigma`` a central target of 1
needs (``ring_for_central``), and the masked payload per client in bytes and in bits per
kept value and per parameter (the exact ring sends whole bytes: its width rounded up to 8).

Usage: python benchmarks/secagg_ring_widths.py [--clients 100 1000] [--kept 3829]
"""

from __future__ import annotations

import argparse

from fedsparse.common.aggregation.secure import (
    central_noise_multiplier,
    choose_ring,
    ring_for_central,
    smallest_threshold,
)

PARAMETERS = 38_282
"""The digits CNN's parameters (``common/models``): bits per parameter are per these."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--kept", type=int, default=3829)
    args = parser.parse_args()
    head = f"{'n':>5} {'ring':>10} {'scale':>9} {'Delta/sC':>9} {'z at sigma=1':>13}"
    head += f" {'sigma for z=1':>14} {'bytes':>7} {'bits/value':>11} {'bits/param':>11}"
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
            try:
                p = choose_ring(sigma=1.0, bits=bits, **ring)  # type: ignore[arg-type]
                name = name if bits else f"exact {p.bits}"
                z = central_noise_multiplier(p, p.threshold)
                sigma = ring_for_central(1.0, bits=bits, **ring).sigma  # type: ignore[arg-type]
            except ValueError as exc:
                print(f"{n:>5} {name:>10}  refused: {exc}")
                continue
            inflation = p.sensitivity / (p.scale * p.clip)
            value_bits = 8 * p.input_bytes / p.kept
            print(
                f"{n:>5} {name:>10} {p.scale:>9.1f} {inflation:>9.3f} {z:>13.3f} {sigma:>14.3f}"
                f" {p.input_bytes:>7,} {value_bits:>11.2f} {8 * p.input_bytes / PARAMETERS:>11.3f}"
            )


if __name__ == "__main__":
    main()
