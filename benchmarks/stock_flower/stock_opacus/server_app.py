"""Stock ServerApp: Flower's ``FedAvg.start`` loop, timed through its own callbacks.

``FedAvg`` is used as shipped: every node trains in every round (``fraction_train=1``), no
federated evaluation (``fraction_evaluate=0``: fedsparse evaluates on the server only), and
the centralized ``evaluate_fn`` evaluates each new model on the held-out test split, as
fedsparse's ServerApp does. Two of ``FedAvg``'s extension points do the bookkeeping:

* ``evaluate_fn`` is called before round 1 and after every round, so round ``r`` runs from
  the end of call ``r - 1`` to the end of call ``r``: it writes ``rounds.jsonl``, one line a
  round with the ``round``/``started_at``/``ended_at``/``wall_seconds`` fields that
  fedsparse's ``RoundLog`` has, so the benchmark reads both apps' files alike. The initial
  model is not evaluated (fedsparse does not evaluate it either);
* ``train_metrics_aggr_fn`` (Flower's default aggregation) also counts the replies, examples
  and steps of the round.

``summary.json`` is written when the run completes (the launcher's sign of success).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, Context, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from stock_opacus.task import StockConfig, build_net, evaluate, test_split

__all__ = ["RoundTimer", "app", "run_stock"]

app = ServerApp()


class RoundTimer:
    """Times ``FedAvg.start``'s rounds and writes ``rounds.jsonl`` and ``summary.json``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rounds: list[dict[str, Any]] = []
        self._counts: dict[str, int] = {}
        self._started, self._started_at = time.perf_counter(), time.time()

    def begin(self) -> None:
        """Round 1 starts now; replaces an earlier run's records."""
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "rounds.jsonl").write_text("")
        (self.out / "summary.json").unlink(missing_ok=True)
        self._started, self._started_at = time.perf_counter(), time.time()

    def aggregate_metrics(self, records: list[RecordDict], weighting: str) -> MetricRecord:
        """Flower's default metric aggregation, plus the round's reply/example/step counts."""
        metrics = [next(iter(r.metric_records.values())) for r in records]
        self._counts = {
            "num_replies": len(records),
            "examples_seen": sum(int(cast(float, m["examples-seen"])) for m in metrics),
            "steps": sum(int(cast(float, m["num-steps"])) for m in metrics),
        }
        return aggregate_metricrecords(records, weighting)

    def round_done(self, server_round: int, *, test_loss: float, test_accuracy: float) -> None:
        """Appends round ``server_round``'s line; the next round starts now."""
        now, now_at = time.perf_counter(), time.time()
        entry = {
            "round": server_round,
            **{"num_replies": 0, "examples_seen": 0, "steps": 0, **self._counts},
            "test_loss": test_loss,
            "test_accuracy": test_accuracy,
            "wall_seconds": now - self._started,
            "started_at": self._started_at,
            "ended_at": now_at,
        }
        self.rounds.append(entry)
        with (self.out / "rounds.jsonl").open("a") as fh:
            fh.write(json.dumps(entry) + "\n")
        self._counts = {}
        self._started, self._started_at = now, now_at

    def finish(self) -> dict[str, Any]:
        """Writes and returns ``summary.json``."""
        last = self.rounds[-1] if self.rounds else {}
        summary = {
            "rounds": len(self.rounds),
            "final_test_accuracy": last.get("test_accuracy"),
            "final_test_loss": last.get("test_loss"),
        }
        (self.out / "summary.json").write_text(json.dumps(summary) + "\n")
        return summary


def run_stock(grid: Grid, cfg: StockConfig) -> dict[str, Any]:
    """Runs every round of stock ``FedAvg``; returns the summary (also ``summary.json``)."""
    torch.set_num_threads(1)
    net = build_net(cfg)
    test = test_split(cfg)
    timer = RoundTimer(Path(cfg.out_dir or "runs/stock-flower"))
    strategy = FedAvg(
        fraction_train=1.0,
        fraction_evaluate=0.0,
        min_train_nodes=cfg.min_nodes,
        min_available_nodes=cfg.min_nodes,
        train_metrics_aggr_fn=timer.aggregate_metrics,
    )

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == 0:
            timer.begin()
            return None
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = evaluate(net, test.x, test.y)
        timer.round_done(server_round, test_loss=loss, test_accuracy=accuracy)
        return MetricRecord({"test-loss": loss, "test-accuracy": accuracy})

    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(net.state_dict()),
        num_rounds=cfg.num_rounds,
        timeout=cfg.round_timeout,
        evaluate_fn=evaluate_fn,
    )
    return timer.finish()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point for ``flwr run``."""
    run_stock(grid, StockConfig.from_run_config(context.run_config))
