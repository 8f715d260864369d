"""What a launcher tells the ServerApp outside Flower's messages: an environment variable and a
file in the run's out-dir (``lab/launch/`` writes them, ``server/loop.py`` and
``server/run_records.py`` read them)."""

from typing import Final

__all__ = ["EXPECTED_NODES_ENV", "STOP_FILE"]

#: How many nodes a simulation started; round 1 waits for all of them (``server/loop.py``,
#: ``wait_for_nodes``).
EXPECTED_NODES_ENV: Final = "FEDSPARSE_EXPECTED_NODES"
#: The launcher is stopping the run. It is written before any process is signalled; the
#: ServerApp records no round once it exists, so a round aggregated while the clients were
#: being killed never reaches the checkpoint.
STOP_FILE: Final = "stop-requested"
