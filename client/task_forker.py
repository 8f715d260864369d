"""A fedsparse node's task forker: the process that runs each ClientApp task of ``fedsparse
node`` (``client/node.py``) in a child forked from it.

It does the imports every task needs once (torch with one intra-op thread and subnormal floats
flushed, Opacus, Flower, the installed ClientApp, the data partitioner) and nothing else, then
reads task tokens from stdin, one a line, and forks a child per token that runs ``run_task``
and exits. Every task so starts from the same state, sees nothing of another task's (memory
is copied on write), and costs a fork instead of an interpreter's start-up and imports
(seconds of CPU a task; a digits round of 3 loopback nodes on 2 cores: 15-21 s before, 6 s).

What a fork shares, and how each is handled in the child:

- **Randomness.** Python's ``random`` reseeds itself after a fork; numpy's legacy global state
  and torch's default generator are reseeded from OS entropy, so no two tasks share a stream.
  The DP noise, Poisson sampling and rounding of a deployed node draw from generators the task
  creates from OS entropy (``common/dp/engine.py: os_entropy_generator``), never from these.
- **The subnormal mode** (``flush_denormals``): a register of each thread, set in the forker
  before any intra-op thread starts; the child's thread keeps it and passes it on.
- **The token pipe.** Tokens are read a byte at a time, so nothing after a task's own token
  is buffered when it forks; the child's stdin is ``/dev/null``.
- **Address-space layout** (ASLR, stack canaries): the same in every child. A child killed by
  a crash signal (a memory error) makes the forker replace itself by a fresh interpreter
  (``exec``) once no task runs, so that a layout cannot be probed over many tasks.
- **Life.** SIGTERM is blocked around each fork, so a task is tracked before a stop can
  reach it; a child dies with the forker (``PR_SET_PDEATHSIG``), and the forker with the node.
  At the end of its tokens (the node closed them, or died) or on SIGTERM the forker stops
  every running task: SIGTERM, then SIGKILL after ``STOP_SECONDS``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from logging import ERROR
from typing import Final

from flwr.common.logger import log

__all__ = ["STOP_SECONDS", "serve_forks"]

#: Seconds a stopping forker gives its running tasks before SIGKILL.
STOP_SECONDS: Final = 10.0
#: Seconds between checks for finished tasks while no token comes.
_REAP_SECONDS: Final = 1.0
#: The signals of a crash: the forker then replaces itself by a fresh interpreter.
_CRASH_SIGNALS: Final = frozenset(
    {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT, signal.SIGFPE, signal.SIGSYS}
)
_PR_SET_PDEATHSIG: Final = 1

#: ``run_task(address, token, root_certificates=..., parent_pid=...)``: the exit code.
RunTask = Callable[..., int]


class _Stop(BaseException):
    """SIGTERM reached the forker (a BaseException: no library's ``except Exception`` eats it)."""


def _on_sigterm(_signum: int, _frame: object) -> None:
    raise _Stop


def _preload(load_app: Callable[[], object]) -> None:
    """What every task imports, done once (``load_app`` imports the ClientApp)."""
    import datasets  # noqa: F401 - what partition_indices imports on its first call
    import flwr_datasets.partitioner  # noqa: F401
    import torch

    from fedsparse.common.dp.engine import flush_denormals

    torch.set_num_threads(1)  # the ClientApp's own setting, before any torch thread starts
    if not flush_denormals():  # subnormal timing (common/dp/optimizer.py)
        log(ERROR, "fedsparse node: this CPU cannot flush subnormal floats to zero")
    load_app()


def _die_with(parent: int) -> None:
    """SIGTERM to this process when ``parent`` dies (Linux); exits at once if it is gone."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)


def _run_child(args: argparse.Namespace, token: str, forker: int, run: RunTask) -> int:
    """In a forked child: one task, as a fresh process would run it (module docstring)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    _die_with(forker)
    os.close(0)  # the forker's token pipe is not the task's
    os.open(os.devnull, os.O_RDONLY)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the process's, for good
    import datasets.fingerprint
    import numpy as np
    import torch

    np.random.seed()
    torch.seed()
    datasets.fingerprint.fingerprint_rng.seed()
    root = None
    if args.root_certificates:
        with open(args.root_certificates, "rb") as fh:
            root = fh.read()
    try:
        return run(
            args.runtime_api_address, token, root_certificates=root, parent_pid=args.parent_pid
        )
    except KeyboardInterrupt:  # the node process is gone (the parent monitor)
        return 130


def _read_line(fd: int) -> bytes | None:
    """The next line of ``fd`` without its newline (None at its end), read a byte at a time:
    nothing after it is read ahead, so no forked task holds the tokens that follow its own."""
    line = bytearray()
    while (byte := os.read(fd, 1)) != b"\n":
        if not byte:
            return bytes(line) if line else None
        line += byte
    return bytes(line)


def _reap(children: set[int], *, block: bool = False) -> bool:
    """Collects the exits of finished tasks (``block``: waits for one); whether one crashed."""
    crashed = False
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done == pid:
            children.discard(pid)
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) in _CRASH_SIGNALS:
                crashed = True
            if block:
                break
    return crashed


def _stop_children(children: set[int]) -> None:
    """SIGTERM to every task still running, SIGKILL to those alive ``STOP_SECONDS`` later."""
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_SECONDS
    while children and time.monotonic() < deadline:
        _reap(children)
        time.sleep(0.05)
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    while children:
        _reap(children, block=True)


def _fork_task(args: argparse.Namespace, token: str, children: set[int], run: RunTask) -> None:
    """Forks the child that runs ``token``'s task and tracks it (SIGTERM held meanwhile)."""
    for stream in (sys.stdout, sys.stderr):  # else every child would print it again
        with contextlib.suppress(Exception):
            stream.flush()
    forker = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        pid = os.fork()
        if pid == 0:  # the child never returns into the forker's loop
            code = 1
            try:
                code = _run_child(args, token, forker, run)
            except BaseException as err:
                log(ERROR, "fedsparse node: the task process failed", exc_info=err)
            finally:
                for stream in (sys.stdout, sys.stderr):
                    with contextlib.suppress(Exception):
                        stream.flush()
                os._exit(code)
        children.add(pid)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def serve_forks(args: argparse.Namespace, *, run: RunTask, load_app: Callable[[], object]) -> int:
    """Runs a task per token read from stdin until its end or SIGTERM (module docstring).

    Args:
        args: ``runtime_api_address``, ``root_certificates`` (a path) and ``parent_pid``.
        run: ``client/node.py: run_task``.
        load_app: imports the node's installed ClientApp.
    """
    _preload(load_app)
    signal.signal(signal.SIGTERM, _on_sigterm)
    children: set[int] = set()
    fresh = False  # a task crashed: exec a fresh forker once none runs
    try:
        while True:
            ready, _, _ = select.select([0], [], [], _REAP_SECONDS)
            fresh = _reap(children) or fresh
            if fresh and not children:
                _exec_fresh(args)
            if not ready:
                continue
            raw = _read_line(0)
            if raw is None:
                break
            token = raw.decode(errors="replace").strip()
            if token:
                _fork_task(args, token, children, run)
    except (_Stop, KeyboardInterrupt):
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _stop_children(children)
    return 0


def _exec_fresh(args: argparse.Namespace) -> None:
    """Replaces this forker by a fresh interpreter with the same arguments and stdin (nothing
    of it is read ahead), its death signal kept."""
    log(ERROR, "fedsparse node: a task crashed; the task forker restarts")
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    argv = [sys.executable, "-P", "-m", "fedsparse.client.node"]
    argv += ["--runtime-api-address", args.runtime_api_address]
    if args.root_certificates:
        argv += ["--root-certificates", args.root_certificates]
    if args.parent_pid is not None:
        argv += ["--parent-pid", str(args.parent_pid)]
    os.execv(sys.executable, argv)
