"""``fedsparse node``: a SuperNode that runs only the code its owner installed.

A Flower 1.39 SuperNode runs whatever ClientApp the SuperLink serves: the run's FAB (app
bundle) comes from the server, and ``flwr-clientapp`` installs it and imports the ClientApp it
names. In a deployment the server is the party that is not trusted, so a FAB of its choosing
could read the node's data and ledger, send them back and reset the budget. What Flower offers
does not close this: ``flower-supernode --trusted-entities`` refuses every FAB whose
verifications lack ``valid_license``, which the SuperLink sets only for FABs fetched from
Flower Hub -- and a hostile SuperLink can set it on anything; the signatures it checks are
made by keys the SuperLink reports, not by the node owner's.

So a fedsparse node never runs server-supplied code. ``fedsparse node [flower-supernode
arguments]`` starts ``flower-supernode --isolation process`` (the SuperNode then launches no
ClientApp itself) and takes over the launcher's job: it polls the SuperNode's Runtime API
(which must listen on loopback) for ClientApp tasks only, and runs each task in a process
of its own (``run_task``), forked from the node's task forker (``client/task_forker.py``), a process
that has done the imports and nothing else: every task starts from that state, none sees
another's, and none pays an interpreter's start-up. That process pulls the task's message,
context, run and FAB, and checks the FAB (``fab_refusal``): its ``clientapp`` must be
fedsparse's own, and when the node's policy lists ``allowed-fab-hashes``, the FAB's SHA-256
(computed here, never taken from the server) must be one of them. It then calls the ClientApp
of the fedsparse installed on the node -- the FAB is never installed, extracted or imported. A
refused FAB gets an error reply naming the reason, and the node's log says so; nothing else
runs, so the ledger and the data are untouched. Task types other than ClientApps (e.g. agent
apps) are never acquired.

What this guarantees, and what not: the code that handles the node's data, noise, policy and
ledger is the code the node owner installed (``pip show fedsparse``). The FAB still carries
the run config's defaults (the server's choice anyway) and the server still chooses every
message; the ClientApp's own checks handle those (``client/guard.py``). A node owner who
runs ``flower-supernode`` directly instead gets Flower's behaviour.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import ipaddress
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from logging import ERROR, INFO
from typing import Final

from flwr.app import Context, Error, Message
from flwr.common.config import get_fab_config
from flwr.common.constant import ErrorCode, SubStatus
from flwr.common.logger import log
from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
from flwr.supercore.app_utils import start_parent_process_monitor
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supernode.runtime.run_clientapp import (
    pull_task_input,
    push_message,
    push_task_output,
)

from fedsparse.client.node_policy import (
    POLICY_ENV,
    NodePolicy,
    check_node_config,
    node_config_text,
)

__all__ = ["CLIENTAPP", "fab_refusal", "run_node", "run_task", "serve_tasks"]

#: The only ClientApp a fedsparse node runs: the one its owner installed.
CLIENTAPP: Final = "fedsparse.client.app:app"
#: Seconds between polls of the SuperNode's Runtime API for new tasks.
POLL_SECONDS: Final = 0.5
#: Seconds a stopping node waits for its task forker (which gives its tasks 10 s) to exit.
_FORKER_EXIT_SECONDS: Final = 15.0
_LOOPBACK_NAMES: Final = frozenset({"localhost"})


def fab_refusal(fab: bytes, policy: NodePolicy) -> str | None:
    """Why this node refuses the FAB ``fab`` (None: it takes part in the run).

    Only the FAB's ``pyproject.toml`` is read (parsed as TOML, never executed).
    """
    digest = hashlib.sha256(fab).hexdigest()
    if policy.allowed_fab_hashes and digest not in policy.allowed_fab_hashes:
        return f"FAB sha256={digest}: not among this node's allowed-fab-hashes"
    try:
        config = get_fab_config(fab)
        clientapp = config["tool"]["flwr"]["app"]["components"]["clientapp"]
    except Exception as err:  # not a zip, no pyproject.toml, bad TOML, missing keys, ...
        return f"FAB sha256={digest}: unreadable ({type(err).__name__})"
    if clientapp != CLIENTAPP:
        return (
            f"FAB clientapp={str(clientapp)[:100]!r}: this node runs only its own installed "
            f"ClientApp, {CLIENTAPP!r}"
        )
    return None


def _node_policy(context: Context) -> NodePolicy:
    from fedsparse.client.guard import node_policy  # the ClientApp's own, with its imports

    return node_policy(context)


def _installed_clientapp() -> Callable[..., Message]:
    from fedsparse.client.app import app

    return app


def run_task(
    runtime_api_address: str,
    token: str,
    *,
    root_certificates: bytes | None = None,
    parent_pid: int | None = None,
) -> int:
    """Runs one ClientApp task of the SuperNode at ``runtime_api_address`` with the node's own
    ClientApp (module docstring); returns the process's exit code (0: a reply was pushed).

    The structure is ``flwr-clientapp``'s (``flwr/supernode/runtime/run_clientapp.py``): pull
    the inputs, run, push the reply and the context, with a heartbeat while it runs; the one
    difference is where the ClientApp comes from.
    """
    if parent_pid is not None:
        start_parent_process_monitor(parent_pid)  # SIGINT when the node process is gone
    retry = make_simple_http_retry_invoker()
    client = RuntimeHttpClient.from_server_address(
        server_address=runtime_api_address,
        insecure=root_certificates is None,
        root_certificates=root_certificates,
        interceptors=[
            RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
            RuntimeTokenHttpInterceptor(token),
        ],
        retry_invoker=retry,
    )
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    message: Message | None = None
    context: Context | None = None
    reply: Message | None = None
    status, details, code = SubStatus.FAILED, "task failed", 1
    try:
        heartbeat.start()
        message, context, _, fab = pull_task_input(client)
        refusal = fab_refusal(fab.content, _node_policy(context))
        if refusal is not None:
            log(ERROR, "fedsparse node: refused run %s: %s", context.run_id, refusal)
            reply = Message(Error(code=ErrorCode.INVALID_FAB, reason=refusal), reply_to=message)
            details = refusal
        else:
            reply = _installed_clientapp()(message=message, context=context)
            status, details, code = SubStatus.COMPLETED, "", 0
    except Exception as err:  # the reply says what Flower's own ClientApp process would
        log(ERROR, "fedsparse node: the ClientApp raised an exception", exc_info=err)
        reason = f"{type(err)}:<'{err}'>"
        details = reason
        if message is not None:
            reply = Message(
                Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason),
                reply_to=message,
            )
    finally:
        retry.max_tries = 1  # do not block the exit on a SuperNode that is gone
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
        except Exception as err:
            log(ERROR, "fedsparse node: failed to push the reply", exc_info=err)
            code = 1
        push_task_output(client=client, context=context, sub_status=status, details=details)
        if heartbeat.is_running:
            heartbeat.stop()
        client.close()
    return code


def serve_tasks(
    runtime_api_address: str,
    *,
    launch: Callable[[str], object],
    stop: threading.Event,
    root_certificates: bytes | None = None,
    poll_seconds: float = POLL_SECONDS,
) -> None:
    """Acquires the SuperNode's ClientApp tasks until ``stop`` is set; ``launch(token)`` runs
    each (``run_node`` starts a ``run_task`` process). No other task type is acquired."""
    client = RuntimeHttpClient.from_server_address(
        server_address=runtime_api_address,
        insecure=root_certificates is None,
        root_certificates=root_certificates,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec")],
        retry_invoker=make_simple_http_retry_invoker(),
    )
    try:
        while not stop.is_set():
            response = client.AcquireTask(
                AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value])
            )
            if response.HasField("task") and response.token:
                try:
                    launch(response.token)
                except OSError as err:  # this task is lost (its lease expires), not the node
                    log(ERROR, "fedsparse node: could not start a task: %s", err)
                continue  # more may be waiting
            stop.wait(poll_seconds)
    finally:
        client.close()


def runtime_api_address(supernode_args: Sequence[str]) -> str:
    """The address ``flower-supernode supernode_args`` serves its Runtime API on.

    Raises:
        ValueError: ``--isolation`` is given (``fedsparse node`` sets it), or the Runtime API
            would listen on a non-loopback address (whoever reaches it could take tasks).
    """
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9094)
    parser.add_argument("--isolation")
    known, _ = parser.parse_known_args(list(supernode_args))
    if known.isolation is not None:
        raise ValueError(
            f"--isolation {known.isolation}: fedsparse node runs the SuperNode with "
            "--isolation process and launches its own ClientApp; leave it out"
        )
    if not _is_loopback(known.host):
        raise ValueError(
            f"--host {known.host}: the Runtime API hands out the node's tasks; it must "
            "listen on loopback (127.0.0.1, ::1 or localhost)"
        )
    host = f"[{known.host}]" if ":" in known.host else known.host
    return f"{host}:{known.port}"


def _is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _Launcher:
    """Hands each task's token to the node's task forker (``task_forker``): one process,
    started once, its imports (torch, Opacus, Flower, the ClientApp) done, that forks a fresh
    child per task. A forker found dead is replaced, and the token goes to the new one."""

    def __init__(self, address: str, certificates: str | None) -> None:
        # -P: nothing from the working directory can shadow an installed module.
        self._command = [sys.executable, "-P", "-m", "fedsparse.client.node"]
        self._command += ["--runtime-api-address", address, "--parent-pid", str(os.getpid())]
        if certificates is not None:
            self._command += ["--root-certificates", certificates]
        self._lock = threading.Lock()
        self._forker = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        # It dies with the node even when the node is killed (SIGKILL): SIGTERM, then its
        # tasks are stopped too (``task_forker``).
        return subprocess.Popen(self._command, stdin=subprocess.PIPE, preexec_fn=_die_with_parent)

    def __call__(self, token: str) -> None:
        line = token.encode() + b"\n"  # not argv: ps would show it
        with self._lock:
            for attempt in (1, 2):
                if self._forker.poll() is not None:
                    self._forker = self._spawn()
                assert self._forker.stdin is not None
                try:
                    self._forker.stdin.write(line)
                    self._forker.stdin.flush()
                    return
                except OSError:  # it died since: a fresh one takes the task
                    if attempt == 2:
                        raise
                    self._forker.kill()
                    self._forker.wait()

    def close(self) -> None:
        """Stops the forker, which stops every task still running (SIGTERM, then SIGKILL)."""
        with self._lock:
            forker = self._forker
        if forker.poll() is None:
            with contextlib.suppress(OSError):
                assert forker.stdin is not None
                forker.stdin.close()  # end of tokens: it stops its tasks and exits
            try:
                forker.wait(_FORKER_EXIT_SECONDS)
            except subprocess.TimeoutExpired:
                forker.kill()
                forker.wait()


def run_node(supernode_args: Sequence[str], *, supernode: str = "flower-supernode") -> int:
    """``fedsparse node``: the SuperNode and its own task launcher, until the SuperNode exits
    or this process gets SIGTERM/SIGINT; returns the SuperNode's exit code.

    Raises:
        ValueError: arguments ``fedsparse node`` does not accept (``runtime_api_address``), or
            a bad node policy or data declaration (``check_node_config``).
    """
    address = runtime_api_address(supernode_args)
    check_node_config(node_config_text(supernode_args), os.environ.get(POLICY_ENV, ""))
    certificates = _runtime_certificates(supernode_args)
    root = None
    if certificates is not None:
        with open(certificates, "rb") as fh:
            root = fh.read()
    stop = threading.Event()
    started: list[subprocess.Popen[bytes]] = []  # the SuperNode, once it runs

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()
        for process in started:
            process.send_signal(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    # The SuperNode dies with this process, even when it is killed (SIGKILL) and cannot stop it.
    node = subprocess.Popen(
        [supernode, "--isolation", "process", *supernode_args], preexec_fn=_die_with_parent
    )
    started.append(node)
    if stop.is_set():  # a signal came while it started
        node.terminate()
    launcher = _Launcher(address, certificates)

    def serve() -> None:
        try:
            serve_tasks(address, launch=launcher, stop=stop, root_certificates=root)
        except Exception as err:
            if not stop.is_set():  # a node that can no longer run tasks must not look alive
                log(ERROR, "fedsparse node: task polling failed (%s); stopping the node", err)
                stop.set()
                node.terminate()

    server = threading.Thread(target=serve, name="fedsparse-node-tasks", daemon=True)
    server.start()
    log(INFO, "fedsparse node: SuperNode pid %d; ClientApp: %s (installed)", node.pid, CLIENTAPP)
    try:
        code = node.wait()
    finally:
        stop.set()
        for s, handler in previous.items():
            signal.signal(s, handler)
        launcher.close()
        if node.poll() is None:
            node.kill()
            node.wait()
    return code


def _die_with_parent() -> None:
    """In the child before ``exec``: SIGTERM when the parent dies (Linux ``PR_SET_PDEATHSIG``;
    elsewhere nothing)."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _runtime_certificates(supernode_args: Sequence[str]) -> str | None:
    """The CA the SuperNode's Runtime API certificate is checked with, if it serves TLS."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--ssl-ca-certfile")
    known, _ = parser.parse_known_args(list(supernode_args))
    return known.ssl_ca_certfile


def _main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedsparse.client.node``: the node's task forker (``task_forker``): a
    ClientApp task per token read from stdin, each in a forked child (``run_task``)."""
    parser = argparse.ArgumentParser(description="Run the ClientApp tasks of a fedsparse node.")
    parser.add_argument("--runtime-api-address", required=True)
    parser.add_argument("--root-certificates")
    parser.add_argument("--parent-pid", type=int)
    from fedsparse.client.task_forker import serve_forks

    # run_task looked up at each task (a test replaces it)
    return serve_forks(
        parser.parse_args(argv),
        run=lambda *a, **kw: run_task(*a, **kw),
        load_app=_installed_clientapp,
    )


if __name__ == "__main__":
    sys.exit(_main())
