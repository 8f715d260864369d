"""The ``fedsparse`` command line: ``main``, the console script (``python -m fedsparse.lab.cli``
alike).

``fedsparse simulate`` runs the federated app on Flower's simulation engine (Ray backend), or
with ``--backend ray`` on Ray workers that each hold many virtual clients
(``lab/simulation/raygrid.py``),
and writes ``rounds.jsonl`` and ``summary.json``; ``fedsparse demo`` is ``simulate`` on the
embedded digits; ``fedsparse train`` runs centralized DP-SGD with random sparsification (RS
paper, Algorithm 1) and writes ``epochs.jsonl`` and ``summary.json``.

The commands are registered in ``app.py``, each written in its own module; this module runs
them: signals stop a command cleanly, an unexpected error is one line.
"""

from __future__ import annotations

import signal

from fedsparse.common.known_warnings import KNOWN_WARNINGS, quiet_known_warnings
from fedsparse.lab.cli.app import app
from fedsparse.lab.cli.train import TRAIN_DEFAULTS
from fedsparse.lab.cli.utils import STATE, console

__all__ = ["QUIET_WARNINGS", "TRAIN_DEFAULTS", "app", "main"]

#: The texts of the warnings a command silences (``common/known_warnings.py``).
QUIET_WARNINGS = tuple(known.message for known in KNOWN_WARNINGS)

#: ``main``'s record of the command's run (``--debug``, the stopping signal), shared with
#: the app's options.
_STATE = STATE


def _on_signal(signum: int, frame: object) -> None:
    """SIGINT, SIGTERM and SIGHUP alike: stop the command and every process it started.

    The first signal interrupts the main thread and asks every wait loop (worker threads
    included) to stop (``processes.request_stop``); each launcher then stops its processes
    by PID (SIGTERM, SIGKILL after a grace period) and the command exits with 128 + the
    signal's number, its results up to then written. Later signals are ignored, so that they
    cannot cut that clean-up short.
    """
    from fedsparse.lab.launch.processes import request_stop, stopping_processes

    if _STATE["signal"] is not None:
        return
    _STATE["signal"] = signum
    request_stop()
    console.print(
        f"[bold red]{signal.Signals(signum).name}[/]: stopping every process of this command"
    )
    if not stopping_processes():  # else the next wait loop raises, after that clean-up
        raise KeyboardInterrupt(signal.Signals(signum).name)


def _one_line(err: BaseException) -> str:
    text = " | ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def main() -> None:
    """Console-script entry point: the command line, without the known warnings
    (``common/known_warnings.py``).

    SIGINT, SIGTERM and SIGHUP stop the command cleanly (``_on_signal``: no process left,
    partial results valid, exit code 128 + signal number). An unexpected error is one line
    (``--debug`` for the traceback).
    """
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, _on_signal) for sig in handled}
    code: int | str | None = 0
    try:
        with quiet_known_warnings():
            try:
                app()
            except SystemExit as exit_:  # click's own exit: usage errors, Abort (our signals)
                code = exit_.code
            except KeyboardInterrupt:
                code = 130
            except Exception as err:
                if _STATE["debug"]:
                    raise
                hint = "[dim](--debug: traceback)[/]"
                console.print(f"[bold red]error:[/] {_one_line(err)} {hint}")
                code = 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if _STATE["signal"] is not None:
        code = 128 + int(_STATE["signal"])
    raise SystemExit(code)
