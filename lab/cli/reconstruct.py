"""``fedsparse reconstruct``: the gradient-inversion study against RS-sparsified (DP-)SGD
updates (``lab/research/inversion/``), the ``fedsparse`` spelling of
``python -m fedsparse.lab.research.inversion``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Final

import typer

from fedsparse.lab.cli.utils import Opt, console

__all__ = ["reconstruct"]

#: The study's defaults (``ExperimentConfig.num_images``, ``InversionConfig.iterations`` and
#: ``.restarts``), spelled out so that ``--help`` does not import torch.
IMAGES: Final = 48
ITERATIONS: Final = 300
RESTARTS: Final = 1


def reconstruct(
    out: Annotated[Path, Opt(help="output: report.md, results.csv, plots")],
    images: Annotated[int, Opt(help="test images attacked per cell")] = IMAGES,
    iterations: Annotated[int, Opt(help="Adam steps per restart")] = ITERATIONS,
    restarts: Annotated[int, Opt(help="dummy initialisations per attack")] = RESTARTS,
    seed: Annotated[int, Opt(help="the study's seed (images, masks, noise)")] = 0,
    threads: Annotated[int, Opt(help="torch threads (performance)")] = 1,
) -> None:
    """Gradient inversion against RS-sparsified updates (RS paper Sec. 5, Fig. 5): Inverting
    Gradients and Thm 5.1's linear attack, over rates and privacy settings, on digits. The
    committed report: docs/reconstruction (about 10 minutes on one core)."""
    import torch

    from fedsparse.lab.research.inversion.attack import InversionConfig
    from fedsparse.lab.research.inversion.grid import ExperimentConfig, run
    from fedsparse.lab.research.inversion.report import write_outputs

    try:
        config = ExperimentConfig(
            num_images=images,
            seed=seed,
            attack=InversionConfig(iterations=iterations, restarts=restarts),
        )
        if threads < 1:
            raise ValueError(f"threads={threads}: expected >= 1")
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    torch.set_num_threads(threads)
    results = run(config)
    given = {"images": (images, IMAGES), "iterations": (iterations, ITERATIONS)}
    given |= {"restarts": (restarts, RESTARTS), "seed": (seed, 0), "threads": (threads, 1)}
    command = f"fedsparse reconstruct --out {out}" + "".join(
        f" --{name} {value}" for name, (value, default) in given.items() if value != default
    )
    write_outputs(results, config, out, command=command)
    console.print(f"[bold green]wrote {out / 'report.md'}[/]")
