"""fedsparse ServerApp: seed-shared sparse masks, sparse-aware FedAvg, byte and privacy accounting.

The app is a thin adapter: it parses the run config and runs the round loop
(``server/loop.py``), which drives the ``SparseFedAvg`` strategy (``server/strategy.py``:
rate schedule, mask seeds, client sampling, downlinks from ``server/downlink.py``, reply
validation in ``server/validation.py``, sparse FedAvg), evaluates on the held-out test set and
writes ``rounds.jsonl``, ``summary.json`` and ``checkpoint.pt`` (``server/run_records.py``).
"""

from __future__ import annotations

import logging
import os

from flwr.app import Context
from flwr.common.logger import ConsoleHandler
from flwr.serverapp import Grid, ServerApp

from fedsparse.common.config import FederatedConfig
from fedsparse.server.loop import expected_nodes, run_federated

__all__ = ["app", "plain_flower_logs", "run_federated"]

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point for ``flwr run``: parses the run config and runs the round loop.

    ``$FEDSPARSE_EXPECTED_NODES`` (set by ``fedsparse simulate``) makes round 1 wait for every
    simulated node (``server/loop.py``).
    """
    plain_flower_logs()
    cfg = FederatedConfig.from_run_config(context.run_config)
    run_federated(grid, cfg, expected_nodes=expected_nodes(os.environ))


def plain_flower_logs() -> None:
    """Flower's log lines in this process once each, and colored only on a terminal.

    Once: Opacus's import calls ``logging.basicConfig``, whose root handler would write every
    line of Flower's logger (which propagates) a second time, with a timestamp. Colored:
    Flower's console handler colors level names always; under ``flwr run`` its stream is a
    pipe to the SuperLink's log stream (``flwr.log`` of ``fedsparse simulate``), not a
    terminal.
    """
    logger = logging.getLogger("flwr")
    logger.propagate = False
    for handler in logger.handlers:
        if isinstance(handler, ConsoleHandler):
            isatty = getattr(handler.stream, "isatty", None)
            handler.colored = bool(callable(isatty) and isatty())
