"""``fedsparse node``'s task forker (``client/node.py: _serve_forks``): one child per token, each
starting from the forker's state, with its own randomness and the forker's subnormal mode; the
end of the tokens and SIGTERM stop it and every task it started.

The forker runs as it does on a node (``python -P -m``-style, in a process of its own); only
``run_task`` is replaced, by a probe that writes what the task would see.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# The forker with run_task replaced: each task writes its pid, its parent, draws from every
# global RNG a task might touch, and whether a subnormal product flushes to zero on its main
# thread and on a thread it starts; a token "sleep" keeps its task running.
_FORKER = r"""
import json, os, random, sys, threading, time
from pathlib import Path
import numpy as np
import torch
import fedsparse.client.node as node

out = Path(sys.argv[1])

def probe(address, token, *, root_certificates=None, parent_pid=None):
    def flushed(box):
        box.append(bool(((torch.full((8,), 1e-30) * 1e-10) == 0).all()))
    in_thread = []
    t = threading.Thread(target=flushed, args=(in_thread,))
    t.start(); t.join()
    main = []
    flushed(main)
    record = {
        "pid": os.getpid(), "ppid": os.getppid(), "parent_pid": parent_pid,
        "numpy": float(np.random.random()), "random": random.random(),
        "torch": float(torch.rand(1)), "flushed": main[0], "flushed_thread": in_thread[0],
        "stdin": sys.stdin.read(),
    }
    (out / f"{token}.json").write_text(json.dumps(record))
    if token == "crash":
        os.abort()
    if token.startswith("sleep"):
        time.sleep(600)
    return 0

node.run_task = probe
sys.exit(node._main(["--runtime-api-address", "127.0.0.1:1", "--parent-pid", str(os.getpid())]))
"""


def _start(tmp_path: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", _FORKER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _wait_for(path: Path, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:  # being written
                pass
        time.sleep(0.05)
    raise AssertionError(f"{path}: not written within {timeout} s")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="os.fork and /proc")
def test_each_token_is_a_forked_task_with_its_own_randomness_and_the_subnormal_mode(
    tmp_path: Path,
) -> None:
    forker = _start(tmp_path)
    try:
        assert forker.stdin is not None
        for name in ("a", "b", "c"):
            forker.stdin.write(f"{name}\n".encode())
            forker.stdin.flush()
        tasks = [_wait_for(tmp_path / f"{name}.json") for name in ("a", "b", "c")]
        forker.stdin.close()  # the end of the tokens: the forker exits
        assert forker.wait(60) == 0, forker.stderr.read().decode()[-2000:] if forker.stderr else ""
    finally:
        if forker.poll() is None:
            forker.kill()
    # a process each, children of the forker, which ran no task itself
    assert len({t["pid"] for t in tasks}) == 3
    assert {t["ppid"] for t in tasks} == {forker.pid}
    assert forker.pid not in {t["pid"] for t in tasks}
    # the parent the task watches is the node (here, the forker's own parent argument)
    assert all(t["parent_pid"] == forker.pid for t in tasks)
    # every global RNG a task might touch differs between children: numpy's legacy state,
    # Python's random and torch's default generator (a copy of the forker's would repeat in
    # every task; the forker's imports leave torch's seeded at random, so even a fresh
    # interpreter's first draw is not the same from one start to the next)
    for rng in ("numpy", "random", "torch"):
        assert len({t[rng] for t in tasks}) == 3, rng
    # the forker set flush-to-zero before any thread: every child and its threads keep it
    assert all(t["flushed"] and t["flushed_thread"] for t in tasks)
    # a task cannot read the tokens that follow it
    assert all(t["stdin"] == "" for t in tasks)


@pytest.mark.skipif(sys.platform != "linux", reason="os.fork and /proc")
@pytest.mark.parametrize("how", ["sigterm", "end of tokens"])
def test_stopping_the_forker_stops_its_running_tasks(tmp_path: Path, how: str) -> None:
    forker = _start(tmp_path)
    try:
        assert forker.stdin is not None
        forker.stdin.write(b"sleep1\nsleep2\n")
        forker.stdin.flush()
        pids = [_wait_for(tmp_path / f"sleep{i}.json")["pid"] for i in (1, 2)]
        assert all(_alive(pid) for pid in pids)
        if how == "sigterm":
            forker.send_signal(signal.SIGTERM)
        else:
            forker.stdin.close()
        assert forker.wait(30) == 0
    finally:
        if forker.poll() is None:
            forker.kill()
        for pid in pids if "pids" in locals() else []:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.skipif(sys.platform != "linux", reason="os.fork and /proc")
def test_a_crashed_task_makes_the_forker_exec_a_fresh_interpreter(tmp_path: Path) -> None:
    """A crash signal may be a memory error being probed: every child shares the forker's
    address-space layout, so the forker replaces itself once no task runs."""
    forker = _start(tmp_path)
    try:
        assert forker.stdin is not None
        forker.stdin.write(b"crash\n")
        forker.stdin.flush()
        _wait_for(tmp_path / "crash.json")
        cmdline = Path(f"/proc/{forker.pid}/cmdline")
        fresh = [b"-P", b"-m", b"fedsparse.client.node"]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and cmdline.read_bytes().split(b"\0")[1:4] != fresh:
            time.sleep(0.1)
        argv = cmdline.read_bytes().split(b"\0")
        assert argv[1:4] == fresh, argv[:2]
        assert argv[4:6] == [b"--runtime-api-address", b"127.0.0.1:1"]
        forker.stdin.close()  # the fresh forker reads the same pipe
        assert forker.wait(60) == 0
    finally:
        if forker.poll() is None:
            forker.kill()
