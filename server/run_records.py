"""The run's files: ``rounds.jsonl`` (a ``RoundLog`` a round), ``summary.json``, ``checkpoint.pt``.

Each round's line is appended and flushed as soon as the round ends, and the checkpoint is
replaced atomically (``fedsparse.common.atomic``: a temporary file, synced, renamed), so a
killed run leaves valid records of every round it finished. ``summary.json`` is written only
when the run completes: its presence is how the launchers tell a finished run (``flwr run``
exits 0 whatever happens to the ServerApp), so a run that ends on failed rounds leaves only
``rounds.jsonl`` (the failed rounds with their reasons) and the checkpoint of the last good
model.

A resumed run (``resume_from``: the round of the checkpoint it continues) keeps the lines of
rounds ``1..resume_from`` and drops any later one (a round the killed run logged but did not
checkpoint, or a line cut short by the kill), so ``summary.json`` covers the whole run.

Each round also goes to the run's experiment trackers (``log``: TensorBoard, MLflow;
``server/tracking.py``), after its records are safe, and a finished run draws ``run.png``
(accuracy, epsilon and uplink bytes per round).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedsparse.common.atomic import SHARED, write_atomically
from fedsparse.common.config import FederatedConfig
from fedsparse.common.layout import ParamLayout
from fedsparse.common.training.configs import planned_engine
from fedsparse.common.wire.run_log import FAILURE_FILE, RoundLog, RunSummary
from fedsparse.server.checkpoint import CHECKPOINT, Checkpoint, CheckpointError
from fedsparse.server.launch_markers import STOP_FILE
from fedsparse.server.tracking import Trackers, plot_run

__all__ = ["RunRecorder", "RunStopped"]


class RunRecorder:
    """Writes one run's records into ``out`` (created by ``begin``, which replaces old ones).

    Args:
        resume_from: 0 starts a new run (previous records are replaced); ``r`` > 0 continues
            the run whose checkpoint is at round ``r`` (its lines of rounds 1..r are kept).
        strategy_state: called after each round for the strategy's part of the checkpoint.

    Raises:
        CheckpointError: ``resume_from`` > 0 and ``rounds.jsonl`` lacks one of its rounds
            (nothing is written).
    """

    def __init__(
        self,
        out: Path,
        cfg: FederatedConfig,
        layout: ParamLayout,
        *,
        resume_from: int = 0,
        strategy_state: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.out = Path(out)
        self.cfg = cfg
        self.layout = layout
        self._strategy_state = strategy_state or dict
        self._kept = _kept_rounds(self.out / "rounds.jsonl", resume_from)
        self.logs: list[RoundLog] = [entry for entry, _ in self._kept]
        self.trackers = Trackers((), self.out, {})  # started by ``begin`` (``log``)

    def begin(self) -> None:
        """Replaces the previous records (a resumed run keeps its rounds): rounds start now.

        Called once the nodes are there, so that a start that fails earlier (a bad
        checkpoint, too few nodes) leaves the previous records as they were.
        """
        self.out.mkdir(parents=True, exist_ok=True)
        _replace_text(self.out / "rounds.jsonl", "".join(line + "\n" for _, line in self._kept))
        (self.out / "summary.json").unlink(missing_ok=True)  # a stale one would read as success
        (self.out / FAILURE_FILE).unlink(missing_ok=True)
        self.trackers = Trackers(self.cfg.trackers, self.out, self.cfg.to_run_config())

    def save_updates(self, server_round: int, updates: dict[int, bytes]) -> None:
        """Writes each payload as ``updates/round-<r>-node-<id>.bin`` (``save-updates``).

        What the server holds of each client: the material of reconstruction-attack studies
        (``lab/research/attacks.py``).
        """
        folder = self.out / "updates"
        folder.mkdir(exist_ok=True)
        for node, payload in updates.items():
            (folder / f"round-{server_round}-node-{node}.bin").write_bytes(payload)

    def round_done(self, entry: RoundLog, weights: torch.Tensor) -> None:
        """Appends the round's line and checkpoints the model it ended with.

        Raises:
            RunStopped: the launcher is stopping the run (``STOP_FILE`` in out-dir): the
                round is not recorded, since its clients may have been killed under it (a
                resumed run plays it again).
        """
        stop = self.out / STOP_FILE
        if stop.exists():
            raise RunStopped(
                f"round {entry.round}: not recorded: the launcher is stopping the run ({stop})"
            )
        self.logs.append(entry)
        with (self.out / "rounds.jsonl").open("a") as fh:
            fh.write(entry.to_json() + "\n")
        Checkpoint(
            round=entry.round,
            weights=weights,
            names=list(self.layout.names),
            shapes=list(self.layout.shapes),
            config=self.cfg.to_run_config(),
            strategy=self._strategy_state(),
        ).save(self.out / CHECKPOINT)
        self.trackers.log_round(entry)  # after the records: a tracker never loses a round

    def finish(self) -> RunSummary:
        """Writes and returns the summary of the completed run.

        A resumed run's summary covers every round and records ``resume=false``: it is the
        summary of the run it continued, which computed what an uninterrupted run computes.
        """
        summary = RunSummary.from_rounds(
            self.logs,
            parameters=self.layout.numel,
            delta=self.cfg.delta,
            config={**self.cfg.to_run_config(), "resume": False},
            engine=_engine(self.cfg),
        )
        (self.out / "summary.json").write_text(summary.to_json())
        self.trackers.close()
        plot_run(self.logs, self.out / "run.png", title=_plot_title(self.cfg))
        return summary


def _engine(cfg: FederatedConfig) -> str | None:
    """The DP engine the clients picked for ``cfg`` ("auto" resolved as they resolve it);
    None where this machine cannot tell (a ``device`` it lacks)."""
    try:
        return planned_engine(cfg.engine, cfg.model_name, cfg.device)
    except Exception:  # noqa: BLE001 - a user's engine may raise anything: record its name
        return None if cfg.engine == "auto" else str(cfg.engine)


def _plot_title(cfg: FederatedConfig) -> str:
    return f"{cfg.method}, {cfg.dataset}, r* = {cfg.final_rate:g}, {cfg.value_dtype} values"


class RunStopped(RuntimeError):
    """The launcher asked the run to stop; the round at hand was not recorded."""


def _kept_rounds(path: Path, resume_from: int) -> list[tuple[RoundLog, str]]:
    """The logged rounds ``1..resume_from`` of ``path``, with their lines (none: a new run)."""
    if resume_from == 0:
        return []
    kept: dict[int, tuple[RoundLog, str]] = {}
    text = path.read_text() if path.exists() else ""
    for line in text.splitlines():
        try:
            entry = RoundLog.from_json(line)
        except (ValueError, TypeError):  # a line cut short by the kill: nothing follows it
            break
        if entry.round <= resume_from:
            kept[entry.round] = (entry, line)  # logged twice: the later line is the record
    missing = [r for r in range(1, resume_from + 1) if r not in kept]
    if missing:
        raise CheckpointError(
            f"{path}: rounds {missing} missing: expected the lines of rounds 1..{resume_from} "
            "that the checkpoint continues"
        )
    return [kept[r] for r in range(1, resume_from + 1)]


def _replace_text(path: Path, text: str) -> None:
    write_atomically(path, text, mode=SHARED)
