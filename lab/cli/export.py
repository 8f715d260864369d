"""``fedsparse export``: a finished run's model as a ``state_dict`` file
(``lab/experiments/export.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedsparse.lab.cli.utils import Opt, console

__all__ = ["export"]


def export(
    run_dir: Annotated[Path, typer.Argument(help="the --out folder of a finished run")],
    out: Annotated[Path, Opt(help="the file to write")] = Path("model.pt"),
) -> None:
    """The run's model (a federated run's global model, or train's) as a state_dict file.

    Load it with ``load_exported(out)`` (``fedsparse.lab.experiments.export``), or by hand:
    ``torch.load(out, weights_only=True)``, then ``build_model(saved["model"],
    num_classes=saved["num_classes"])`` and ``load_state_dict(saved["state_dict"])``.
    """
    from fedsparse.lab.experiments.export import export_model

    try:
        exported = export_model(run_dir, out)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    where = "" if exported["round"] is None else f" after round {exported['round']}"
    console.print(f"wrote {out}: model {exported['model']}{where}")
