"""fedsparse ServerApp: seed-shared sparse masks, sparse-aware FedAvg, byte and privacy accounting.

The app is a thin adapter: it parses the run config and runs the round loop
(``server/loop.py``), which drives the ``SparseFedAvg`` strategy (``server/strategy.py``:
rate schedule, mask seeds, client sampling, downlinks from ``server/downlink.py``, reply
validation in ``server/validation.py``, sparse FedAvg), evaluates on the held-out test set and
writes ``rounds.jsonl``, ``summary.json`` and ``checkpoint.pt`` (``server/run_records.py``).
"""

from __future__ import annotations

import os

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedsparse.common.config import FederatedConfig
from fedsparse.server.loop import expected_nodes, run_federated

__all__ = ["app", "run_federated"]

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point for ``flwr run``: parses the run config and runs the round loop.

    ``$FEDSPARSE_EXPECTED_NODES`` (set by ``fedsparse simulate``) makes round 1 wait for every
    simulated node (``server/loop.py``).
    """
    cfg = FederatedConfig.from_run_config(context.run_config)
    run_federated(grid, cfg, expected_nodes=expected_nodes(os.environ))
