"""The run's checkpoint: everything a resumed run (``resume=true``) needs to continue exactly.

``checkpoint.pt`` is replaced atomically after every round (written to a temporary file,
flushed to disk, then renamed), so a killed run leaves the checkpoint of the last round it
finished. It holds:

* ``format`` (``CHECKPOINT_FORMAT``): any other value is refused;
* ``round``: the last finished round; ``weights``: the flat float32 global model after it,
  with the layout's ``names`` and ``shapes`` (a model of another layout is refused);
* ``config``: the run config (``FederatedConfig.to_run_config``); a resumed run must match it
  on every key but ``RESUME_MAY_DIFFER``;
* ``strategy``: ``SparseFedAvg.state_dict()``: the client-sampling generator's state, the
  clients' last reported epsilons and the failed rounds in a row.

What it does not hold, and why: the downlink cache (which model version each node holds). A
resumed run is a new Flower run: every node starts with an empty ``Context`` (and, in a
simulation, a new node id), so no node still holds a version the server could patch; each
gets the dense model the first time it is selected. That changes the downlink bytes of those
rounds, never the model. The seeded streams of the clients depend on (seed, round, partition)
only, and the rate schedule and mask seeds on (seed, round), so nothing else is needed.

Loading is a trust boundary of its own kind (a stale or foreign file): a missing, unreadable,
foreign-format or mismatched checkpoint raises ``CheckpointError`` naming the file and the
field, before any record of the run is touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch

from fedsparse.common.atomic import SHARED, open_atomic
from fedsparse.common.config import RESUME_MAY_DIFFER, FederatedConfig, with_added_keys
from fedsparse.common.layout import ParamLayout

__all__ = [
    "CHECKPOINT",
    "CHECKPOINT_FORMAT",
    "Checkpoint",
    "CheckpointError",
    "check_resumable",
    "load_checkpoint",
]

#: The checkpoint's file name in the run's out-dir.
CHECKPOINT: Final = "checkpoint.pt"

#: Version of the checkpoint's contents. 1: round, weights, names, shapes, config (no key).
CHECKPOINT_FORMAT: Final = 2

_ABSENT: Final = "<absent>"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (the file and the reason are named)."""


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """The state after round ``round`` (see the module for each field)."""

    round: int
    weights: torch.Tensor
    names: list[str]
    shapes: list[tuple[int, ...]]
    config: dict[str, Any]
    strategy: dict[str, Any] = field(default_factory=dict)

    def save(self, path: Path) -> None:
        """Writes the checkpoint to ``path`` atomically (``fedsparse.common.atomic``)."""
        with open_atomic(path, mode=SHARED) as fh:
            torch.save(
                {
                    "format": CHECKPOINT_FORMAT,
                    "round": self.round,
                    "weights": self.weights.detach().clone(),
                    "names": list(self.names),
                    "shapes": [tuple(s) for s in self.shapes],
                    "config": dict(self.config),
                    "strategy": self.strategy,
                },
                fh,
            )


def load_checkpoint(path: Path, *, cfg: FederatedConfig, layout: ParamLayout) -> Checkpoint:
    """The checkpoint at ``path``, checked against the resumed run's ``cfg`` and ``layout``.

    Raises:
        CheckpointError: no file, an unreadable file, another format, another model layout,
            or a config that differs on a key outside ``RESUME_MAY_DIFFER`` (named with both
            values).
    """
    checkpoint = check_resumable(path, cfg=cfg)
    _check_layout(Path(path), checkpoint, layout)
    if checkpoint.round > cfg.num_rounds:
        raise CheckpointError(
            f"checkpoint {path}: round={checkpoint.round}: expected <= num-rounds={cfg.num_rounds}"
        )
    return checkpoint


def check_resumable(path: Path, *, cfg: FederatedConfig) -> Checkpoint:
    """The checkpoint at ``path``, checked as far as no model is needed: the file, its format
    and the run config (a launcher checks this before it starts anything).

    Raises:
        CheckpointError: as ``load_checkpoint``, but for the model's layout and the round.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"resume=true: no checkpoint at {path}: nothing to resume (start without resume)"
        )
    try:
        data = torch.load(path, weights_only=True)
    except Exception as err:  # truncated or foreign files raise many different errors
        raise CheckpointError(f"checkpoint {path}: unreadable ({type(err).__name__})") from None
    if not isinstance(data, Mapping):
        raise CheckpointError(f"checkpoint {path}: expected a mapping, got {type(data).__name__}")
    version = data.get("format", 1)
    if version != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {path}: format={version!r}: expected {CHECKPOINT_FORMAT} "
            "(written by another fedsparse version)"
        )
    checkpoint = _parse(path, data)
    _check_config(path, checkpoint.config, cfg.to_run_config())
    return checkpoint


def _parse(path: Path, data: Mapping[str, Any]) -> Checkpoint:
    """The fields of ``data``, each checked for its type."""
    kinds = {
        "round": int,
        "weights": torch.Tensor,
        "names": list,
        "shapes": list,
        "config": dict,
        "strategy": dict,
    }
    for key, kind in kinds.items():
        value = data.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            got = "missing" if key not in data else type(value).__name__
            raise CheckpointError(f"checkpoint {path}: {key}: expected {kind.__name__}, got {got}")
    if data["round"] < 0:
        raise CheckpointError(f"checkpoint {path}: round={data['round']}: expected >= 0")
    return Checkpoint(
        round=data["round"],
        weights=data["weights"],
        names=list(data["names"]),
        shapes=[tuple(s) for s in data["shapes"]],
        config=dict(data["config"]),
        strategy=dict(data["strategy"]),
    )


def _check_config(path: Path, saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    saved = with_added_keys(saved)  # a checkpoint older than a key ran at its old behaviour
    for key in sorted(set(saved) | set(current)):
        if key in RESUME_MAY_DIFFER:
            continue
        old, new = saved.get(key, _ABSENT), current.get(key, _ABSENT)
        if old != new and not (old != old and new != new):  # NaN equals NaN here
            raise CheckpointError(
                f"resume=true: {key}={new!r}, but the checkpoint {path} was written with "
                f"{key}={old!r}: a resumed run must keep every key but "
                f"{', '.join(sorted(RESUME_MAY_DIFFER))}"
            )


def _check_layout(path: Path, checkpoint: Checkpoint, layout: ParamLayout) -> None:
    shapes = [tuple(s) for s in layout.shapes]
    if checkpoint.names != list(layout.names) or checkpoint.shapes != shapes:
        raise CheckpointError(f"checkpoint {path}: names/shapes: expected the model's layout")
    weights = checkpoint.weights
    if weights.dtype != torch.float32 or weights.shape != (layout.numel,):
        raise CheckpointError(
            f"checkpoint {path}: weights: {weights.dtype} {tuple(weights.shape)}: expected "
            f"float32 ({layout.numel},)"
        )
    if not bool(torch.isfinite(weights).all()):
        raise CheckpointError(f"checkpoint {path}: weights: expected finite values")
