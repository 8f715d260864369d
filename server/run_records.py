"""The run's files: ``rounds.jsonl`` (a ``RoundLog`` a round), ``summary.json``, ``checkpoint.pt``.

Each round's line is appended and flushed as soon as the round ends, and the checkpoint is
replaced atomically (written to a temporary file, then renamed), so a killed run leaves valid
records of every round it finished. ``summary.json`` is written only when the run completes:
its presence is how the launchers tell a finished run (``flwr run`` exits 0 whatever happens
to the ServerApp), so a run that ends on failed rounds leaves only ``rounds.jsonl`` (the
failed rounds with their reasons) and the checkpoint of the last good model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fedsparse.common.config import FederatedConfig
from fedsparse.common.layout import ParamLayout
from fedsparse.common.records import RoundLog, RunSummary

__all__ = ["RunRecorder"]


class RunRecorder:
    """Writes one run's records into ``out`` (created; previous records are replaced)."""

    def __init__(self, out: Path, cfg: FederatedConfig, layout: ParamLayout) -> None:
        self.out = Path(out)
        self.cfg = cfg
        self.layout = layout
        self.logs: list[RoundLog] = []
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "rounds.jsonl").write_text("")
        (self.out / "summary.json").unlink(missing_ok=True)  # a stale one would read as success

    def save_updates(self, server_round: int, updates: dict[int, bytes]) -> None:
        """Writes each payload as ``updates/round-<r>-node-<id>.bin`` (``save-updates``).

        What the server holds of each client: the material of reconstruction-attack studies
        (``lab/attacks.py``).
        """
        folder = self.out / "updates"
        folder.mkdir(exist_ok=True)
        for node, payload in updates.items():
            (folder / f"round-{server_round}-node-{node}.bin").write_bytes(payload)

    def round_done(self, entry: RoundLog, weights: torch.Tensor) -> None:
        """Appends the round's line and checkpoints the model it ended with."""
        self.logs.append(entry)
        with (self.out / "rounds.jsonl").open("a") as fh:
            fh.write(entry.to_json() + "\n")
        tmp = self.out / "checkpoint.pt.tmp"
        torch.save(
            {
                "round": entry.round,
                "weights": weights.clone(),
                "names": self.layout.names,
                "shapes": self.layout.shapes,
                "config": self.cfg.to_run_config(),
            },
            tmp,
        )
        tmp.replace(self.out / "checkpoint.pt")

    def finish(self) -> RunSummary:
        """Writes and returns the summary of the completed run."""
        summary = RunSummary.from_rounds(
            self.logs,
            parameters=self.layout.numel,
            delta=self.cfg.delta,
            config=self.cfg.to_run_config(),
        )
        (self.out / "summary.json").write_text(summary.to_json())
        return summary
