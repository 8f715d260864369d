"""``python -m fedsparse.lab.research.inversion --out DIR``: runs the gradient-inversion grid
and writes its outputs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from fedsparse.lab.research import inversion
from fedsparse.lab.research.inversion.attack import InversionConfig
from fedsparse.lab.research.inversion.grid import ExperimentConfig, run
from fedsparse.lab.research.inversion.report import write_outputs

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedsparse.lab.research.inversion --out DIR``: run the grid and write its
    outputs."""
    parser = argparse.ArgumentParser(
        prog="python -m fedsparse.lab.research.inversion", description=inversion.__doc__
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--images", type=int, default=ExperimentConfig.num_images)
    parser.add_argument("--iterations", type=int, default=InversionConfig.iterations)
    parser.add_argument("--restarts", type=int, default=InversionConfig.restarts)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (performance)")
    args = parser.parse_args(argv)
    try:
        config = ExperimentConfig(
            num_images=args.images,
            seed=args.seed,
            attack=InversionConfig(iterations=args.iterations, restarts=args.restarts),
        )
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    results = run(config)
    given = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(["python -m fedsparse.lab.research.inversion", *given])
    write_outputs(results, config, args.out, command=command)
    print(f"wrote {args.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
