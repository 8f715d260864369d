"""A run's model as a ``state_dict`` that ``build_model`` (or the user's own class) loads.

``fedsparse export RUN --out model.pt`` reads what the run left:

* a federated run (``simulate``, ``deploy``, ``sweep``): ``checkpoint.pt``, the flat global
  model after the last finished round with its layout and run config (``server/checkpoint.py``);
* a centralized run (``train``): ``model.pt``, already a ``state_dict``.

and writes ``{"state_dict": ..., "model": name, "num_classes": 10, "round": r}`` loadable with
``torch.load(path, weights_only=True)``::

    saved = torch.load("model.pt", weights_only=True)
    model = build_model(saved["model"], num_classes=saved["num_classes"])
    model.load_state_dict(saved["state_dict"])

The state dict is the model's whole ``state_dict`` (persistent buffers included), so
``load_state_dict`` is strict.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path
from typing import Any, Final

import torch

from fedsparse.common.atomic import SHARED, open_atomic
from fedsparse.common.config import FederatedConfig
from fedsparse.common.layout import ParamLayout
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.plugins import is_reference

__all__ = ["EXPORT_FORMAT", "MODEL_FILE", "export_model", "load_exported"]

#: The centralized run's model file (``train`` writes it), and the export's default name.
MODEL_FILE: Final = "model.pt"
#: Version of the exported file's contents.
EXPORT_FORMAT: Final = 1
_NUM_CLASSES: Final = 10


def export_model(run: str | os.PathLike[str], out: str | os.PathLike[str]) -> dict[str, Any]:
    """Writes ``run``'s model to ``out`` (module docstring); returns what it wrote.

    Raises:
        ValueError: ``run`` holds neither ``checkpoint.pt`` nor ``model.pt``, or what it holds
            does not fit the model it names (the file and the reason are named); ``out`` is a
            folder.
    """
    run, out = Path(run), Path(out)
    if out.is_dir():
        raise ValueError(f"--out {out}: is a folder; expected a file name (e.g. model.pt)")
    checkpoint, model_file = run / "checkpoint.pt", run / MODEL_FILE
    if checkpoint.is_file():
        exported = _from_checkpoint(checkpoint)
    elif model_file.is_file():
        exported = _from_model_file(model_file)
    else:
        raise ValueError(
            f"{run}: no checkpoint.pt (a federated run's) or {MODEL_FILE} (a train run's); "
            "expected the --out folder of a finished run"
        )
    _write(out, exported)
    return exported


def load_exported(
    path: str | os.PathLike[str], *, plugins: Collection[str] = ()
) -> torch.nn.Module:
    """The model an ``export_model`` file holds, built and loaded (strictly).

    The file names its model; a user's model (``package.module:factory``) is built only if
    ``plugins`` lists it: building imports and calls it, and a file from someone else must
    not choose code to run (``weights_only=True`` keeps ``torch.load`` itself safe).

    Raises:
        ValueError: another format, or a model reference ``plugins`` does not list.
    """
    saved = torch.load(Path(path), weights_only=True)
    if saved.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{path}: format={saved.get('format')!r}: expected {EXPORT_FORMAT}")
    name = str(saved["model"])
    if is_reference(name) and name not in plugins:
        raise ValueError(
            f"{path}: model={name!r} is a user's model: pass plugins=[{name!r}] to build it "
            "(only for a file you trust)"
        )
    model = build_model(saved["model"], num_classes=saved["num_classes"], seed=0)
    model.load_state_dict(saved["state_dict"])
    return model


def _from_checkpoint(path: Path) -> dict[str, Any]:
    data = torch.load(path, weights_only=True)
    try:
        config = data["config"]
        try:
            cfg = FederatedConfig.from_run_config(config)
        except ValueError:  # a run recorded before a refusal (int2 with error feedback, ...)
            cfg = FederatedConfig.from_run_config({"model": config["model"]})  # its model
        weights, names, round_ = data["weights"], list(data["names"]), int(data["round"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: not a fedsparse checkpoint ({err})") from None
    model = build_model(cfg.model_name, num_classes=_NUM_CLASSES, seed=0)
    layout = ParamLayout.from_module(model)
    if list(layout.names) != names or layout.numel != weights.numel():
        raise ValueError(
            f"{path}: weights of {len(names)} tensors ({weights.numel()} values) do not fit "
            f"model={cfg.model_name!r} ({len(layout.names)} tensors, {layout.numel} values)"
        )
    layout.load_flat_(model, weights)
    return _exported(model, cfg.model_name, round_)


def _from_model_file(path: Path) -> dict[str, Any]:
    saved = torch.load(path, weights_only=True)
    if saved.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{path}: format={saved.get('format')!r}: expected {EXPORT_FORMAT}")
    return saved


def _exported(model: torch.nn.Module, name: str, round_: int | None) -> dict[str, Any]:
    return {
        "format": EXPORT_FORMAT,
        "model": name,
        "num_classes": _NUM_CLASSES,
        "round": round_,
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def save_trained(model: torch.nn.Module, name: str, out_dir: Path) -> Path:
    """What ``train`` writes next to its summary: ``model.pt`` in the export's format."""
    path = Path(out_dir) / MODEL_FILE
    _write(path, _exported(model.cpu(), name, None))
    return path


def _write(path: Path, exported: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_atomic(path, mode=SHARED) as fh:
        torch.save(exported, fh)
