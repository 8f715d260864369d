"""The Ray side of ``RayGrid``: a fixed set of Ray actors, each holding many virtual clients.

``VirtualClients`` is one worker's virtual clients: their ``Context``s (``node_config``,
``run_config``, ``state``, which never leave the worker) and the ClientApp that serves a batch of
their messages per remote call, with an error reply where the ClientApp raises.
``RayWorkers`` makes it a set of Ray actors (by default one per free CPU; with
``gpus_per_client`` a fractional GPU each) that lives for a whole run or a whole sweep, and
``worker_count`` says how many fit. ``ray_cluster`` starts a local Ray cluster for this
process (or attaches to an existing one given its address: ``--ray-address``,
``FEDSPARSE_RAY_ADDRESS``), or reuses the one that is running, and shuts down only what it
started.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import resource
import signal
import socket
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from fedsparse.common.data import dataset_files
from fedsparse.lab.simulation.local_grid import trained

__all__ = [
    "RAY_ADDRESS_ENV",
    "ClientFn",
    "RayWorkers",
    "VirtualClients",
    "WorkerStats",
    "error_reply",
    "ray_address",
    "ray_cluster",
    "worker_count",
]

ClientFn = Callable[[Message, Context], Message]

#: Seconds the workers get to start (a worker that needs more resources than are free waits).
START_TIMEOUT = 300.0
#: The environment variable that names a Ray cluster to attach to (as ``--ray-address``).
RAY_ADDRESS_ENV = "FEDSPARSE_RAY_ADDRESS"
#: Seconds a cluster address gets to answer before the run stops with an error.
CONNECT_TIMEOUT = 10.0
#: Seconds ``RayWorkers.close`` waits for the cluster to count the workers' CPUs as free.
RELEASE_TIMEOUT = 10.0


def error_reply(msg: Message, err: BaseException) -> Message:
    """The reply Flower's runtimes give when the ClientApp raises: an error, no content."""
    reason = f"{type(err).__name__}: {err}"
    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)


@dataclass(frozen=True, kw_only=True)
class WorkerStats:
    """What one worker holds and did since its clients were assigned."""

    pid: int
    clients: int
    calls: int  # remote ``handle`` calls (one per round the worker had messages in)
    messages: int
    state_bytes: int  # the virtual clients' ``Context.state``, pickled (model copy + accountant)
    context_bytes: int  # their whole ``Context``s, pickled (state, node and run config)
    rss_bytes: int  # the worker process's resident memory now
    peak_rss_bytes: int  # and at its peak
    gpu_ids: tuple[str, ...]  # the GPUs Ray assigned to the worker
    node_id: str = ""  # the Ray node the worker runs on (hex; "" outside Ray)
    together: int = 0  # of ``messages``, those answered in a vectorised batch


def _is_fedsparse_app(client_app: object) -> bool:
    from fedsparse.client.app import app

    return client_app is app


def _rss_bytes() -> tuple[int, int]:
    """(resident, peak resident) bytes of this process (Linux ``/proc``; peak from rusage)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"), peak
    except OSError:
        return peak, peak


class VirtualClients:
    """One worker's virtual clients: their ``Context``s and the ClientApp that serves them.

    A plain class (``RayWorkers`` makes it a Ray actor), so it can be tested without Ray.
    """

    def __init__(self, client_app: ClientApp | ClientFn, *, vectorised: bool = False) -> None:
        """``vectorised``: a batch's train messages answered together
        (``lab/simulation/population.py``), the others one at a time; the caller has checked
        that ``client_app`` is fedsparse's (``RayWorkers``: on the driver, as Ray hands the
        worker a copy of the app, which no identity check recognises)."""
        self._app = client_app
        self._vectorised = vectorised
        if vectorised:
            from fedsparse.lab.simulation.population import warm_up

            warm_up()
        self._contexts: dict[int, Context] = {}
        self._overrides: dict[int, ClientFn] = {}
        self._calls = self._messages = self._together = 0

    def assign(
        self,
        *,
        run_id: int,
        nodes: Sequence[tuple[int, int]],
        num_partitions: int,
        node_config: Mapping[str, Any],
        run_config: Mapping[str, Any],
        overrides: Mapping[int, ClientFn],
    ) -> int:
        """Replaces the clients by fresh ones, a ``(node id, partition id)`` each; the pid.

        Raises:
            FileNotFoundError: the run's dataset files are not where ``data-dir`` says on this
                worker's machine (``dataset_files``); the message names the Ray node.
        """
        _check_data(run_config)
        self._contexts = {
            node: Context(
                run_id=run_id,
                node_id=node,
                node_config={
                    "partition-id": partition,
                    "num-partitions": num_partitions,
                    **node_config,
                },
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for node, partition in nodes
        }
        self._overrides = dict(overrides)
        self._calls = self._messages = self._together = 0
        return os.getpid()

    def handle(self, batch: Sequence[Message]) -> list[Message]:
        """Each message's reply, in order: the ClientApp with its node's ``Context``."""
        return self.handle_counted(batch)[0]

    def handle_counted(self, batch: Sequence[Message]) -> tuple[list[Message], dict[str, int]]:
        """``handle``'s replies and what trained them (``{runner: count}``, as
        ``LocalGrid.take_runners``): what ``RayGrid`` calls."""
        self._calls += 1
        self._messages += len(batch)
        together: dict[int, Message] = {}
        runners: Counter[str] = Counter()
        if self._vectorised:
            from fedsparse.lab.simulation.population import batched, train_together

            chosen = [k for k, msg in enumerate(batch) if batched(msg, self._overrides)]
            answers = train_together([batch[k] for k in chosen], self._contexts, runners=runners)
            together = dict(zip(chosen, answers, strict=True))
            self._together += len(chosen)
        replies = []
        for k, msg in enumerate(batch):
            if k in together:
                replies.append(together[k])
                continue
            node = msg.metadata.dst_node_id
            handler = self._overrides.get(node, self._app)
            try:
                reply = handler(msg, self._contexts[node])
            except Exception as err:  # the real runtimes turn exceptions into error replies
                reply = error_reply(msg, err)
            if trained(msg, reply):
                runners["client-app"] += 1
            replies.append(reply)
        return replies, dict(runners)

    def stats(self) -> WorkerStats:
        """What this worker holds (sizes measured by pickling) and its memory."""
        rss, peak = _rss_bytes()
        peak = max(peak, rss)  # rusage's peak lags the current size by a page or so
        # Outside Ray (a test), ray.get_gpu_ids would start a cluster: ask only inside it.
        inside = ray.is_initialized()
        gpus = tuple(str(g) for g in ray.get_gpu_ids()) if inside else ()
        node = ray.get_runtime_context().get_node_id() if inside else ""
        return WorkerStats(
            pid=os.getpid(),
            clients=len(self._contexts),
            calls=self._calls,
            messages=self._messages,
            state_bytes=sum(len(pickle.dumps(c.state)) for c in self._contexts.values()),
            context_bytes=sum(len(pickle.dumps(c)) for c in self._contexts.values()),
            rss_bytes=rss,
            peak_rss_bytes=peak,
            gpu_ids=gpus,
            node_id=node,
            together=self._together,
        )


def _check_data(run_config: Mapping[str, Any]) -> None:
    """Raises where this machine lacks the files of the run's dataset, naming the machine."""
    name, data_dir = str(run_config.get("dataset", "digits")), str(run_config.get("data-dir", ""))
    try:
        dataset_files(name, data_dir=data_dir or None)
    except (FileNotFoundError, ValueError) as err:
        if ray.is_initialized():
            where = (
                f"Ray node {ray.get_runtime_context().get_node_id()[:12]} "
                f"({ray.util.get_node_ip_address()}, host {socket.gethostname()})"
            )
        else:
            where = f"host {socket.gethostname()}"
        raise FileNotFoundError(
            f"{where}: {err}. Every node of the cluster reads the dataset from the same "
            "data-dir: copy the files there (or mount them) on each node"
        ) from None


def worker_count(
    *,
    cpus: float,
    gpus: float,
    cpus_per_client: float,
    gpus_per_client: float,
) -> int:
    """How many workers fit in ``cpus`` and ``gpus``: each trains one client at a time.

    Raises:
        ValueError: a non-positive ``cpus_per_client``, a negative ``gpus_per_client``, or
            not even one worker fits (naming what is short).
    """
    if not cpus_per_client > 0:
        raise ValueError(f"cpus_per_client={cpus_per_client}: expected > 0")
    if not (math.isfinite(gpus_per_client) and gpus_per_client >= 0):
        raise ValueError(f"gpus_per_client={gpus_per_client}: expected a finite value >= 0")
    # The tolerance absorbs float residue (0.3 / 0.1 = 2.9999999999999996).
    count = math.floor(cpus / cpus_per_client + 1e-9)
    if count < 1:
        raise ValueError(
            f"cpus_per_client={cpus_per_client}: the Ray cluster has {cpus:g} free CPUs"
        )
    if gpus_per_client > 0:
        count = min(count, math.floor(gpus / gpus_per_client + 1e-9))
        if count < 1:
            raise ValueError(
                f"gpus_per_client={gpus_per_client}: the Ray cluster has {gpus:g} free GPUs"
            )
    return count


class RayWorkers:
    """A fixed set of Ray actors holding virtual clients; reusable across runs (a sweep).

    Needs a running Ray cluster (``ray_cluster``). Use as a context manager, or ``close``.

    Args:
        client_app: the ClientApp; sent to each worker once (a module attribute, as
            ``fedsparse.client.app.app``, travels as a reference the worker imports).
        num_workers: default as many as the free CPUs (and GPUs) hold.
        cpus_per_client: Ray CPUs per worker: a worker trains one virtual client at a time.
        gpus_per_client: Ray GPUs per worker, fractional: 0.25 puts four workers on a GPU.
        vectorised: each worker answers a call's train messages together, the clients'
            DP-SGD steps vectorised across them (``population`` backend's runner,
            ``lab/simulation/population.py``), when the ClientApp is fedsparse's.

    Raises:
        ValueError: the cluster cannot hold ``num_workers`` (or one) such workers.
        RuntimeError: no Ray cluster, or the workers did not start in ``START_TIMEOUT``.
    """

    def __init__(
        self,
        client_app: ClientApp | ClientFn,
        *,
        num_workers: int | None = None,
        cpus_per_client: float = 1.0,
        gpus_per_client: float = 0.0,
        vectorised: bool = False,
    ) -> None:
        if not ray.is_initialized():
            raise RuntimeError("no Ray cluster in this process: start one with ray_cluster()")
        free = ray.available_resources()
        fits = worker_count(
            cpus=free.get("CPU", 0.0),
            gpus=free.get("GPU", 0.0),
            cpus_per_client=cpus_per_client,
            gpus_per_client=gpus_per_client,
        )
        if num_workers is not None and not 1 <= num_workers <= fits:
            raise ValueError(f"num_workers={num_workers}: expected 1..{fits} (free resources)")
        self.cpus_per_client, self.gpus_per_client = cpus_per_client, gpus_per_client
        if vectorised and not _is_fedsparse_app(client_app):
            raise ValueError(
                "vectorised=True: only fedsparse's ClientApp (fedsparse.client.app.app) has "
                "its train step vectorised across clients"
            )
        self._app, self.vectorised = client_app, vectorised
        self._remote = ray.remote(VirtualClients).options(
            num_cpus=cpus_per_client, num_gpus=gpus_per_client
        )
        self.actors: list[Any] = [self._start() for _ in range(num_workers or fits)]
        try:
            ray.get([a.stats.remote() for a in self.actors], timeout=START_TIMEOUT)
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise RuntimeError(
                f"{len(self.actors)} Ray workers did not start in {START_TIMEOUT:.0f} s"
            ) from None
        except BaseException:  # a worker that cannot start (an import error), a stop
            self.close()
            raise

    def _start(self) -> Any:
        return self._remote.remote(self._app, vectorised=self.vectorised)

    def assign(self, index: int, **kwargs: Any) -> Any:
        """``VirtualClients.assign`` on worker ``index``; a dead worker is replaced first.

        Raises:
            FileNotFoundError: the worker's machine lacks the dataset's files (its message,
                not Ray's traceback).
        """
        try:
            try:
                return ray.get(self.actors[index].assign.remote(**kwargs))
            except ray.exceptions.RayActorError:
                self.actors[index] = self._start()
                return ray.get(self.actors[index].assign.remote(**kwargs))
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, FileNotFoundError):
                raise FileNotFoundError(str(err.cause)) from None
            raise

    def stats(self) -> list[WorkerStats]:
        """Each worker's ``WorkerStats``, in worker order."""
        return list(ray.get([a.stats.remote() for a in self.actors]))

    def close(self) -> None:
        """Stops the workers (their processes end; the cluster stays) and frees their CPUs.

        Waits (up to ``RELEASE_TIMEOUT``) until the cluster counts their CPUs as free again:
        ``ray.kill`` is asynchronous, and workers started right after would not fit.
        """
        if not self.actors:
            return
        held = len(self.actors) * self.cpus_per_client  # less if one died (already freed)
        freed = min(
            ray.cluster_resources().get("CPU", 0.0),
            ray.available_resources().get("CPU", 0.0) + held,
        )
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self.actors = []
        deadline = time.monotonic() + RELEASE_TIMEOUT
        while time.monotonic() < deadline:
            if ray.available_resources().get("CPU", 0.0) + 1e-9 >= freed:
                return
            time.sleep(0.05)

    def __enter__(self) -> RayWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ray_address(address: str | None = None) -> str:
    """The cluster to use: ``address``, else ``FEDSPARSE_RAY_ADDRESS``, else ``"local"``.

    ``"local"`` starts a cluster of our own (never one that ``ray start`` left behind);
    ``"auto"`` is the cluster that ``RAY_ADDRESS`` or the last ``ray start`` on this machine
    names; ``HOST:PORT`` is a cluster's head (its GCS port, 6379 by default).

    Raises:
        ValueError: an address that is none of these.
    """
    value = (address or os.environ.get(RAY_ADDRESS_ENV, "") or "local").strip()
    if value in ("local", "auto"):
        return value
    host, sep, port = value.rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"ray_address={value!r}: expected auto, local or HOST:PORT")
    return value


def _reachable(address: str) -> str:
    """``address`` (``auto`` resolved to ``HOST:PORT``) once its head answers on TCP.

    Raises:
        RuntimeError: no cluster found for ``auto``, or nothing answers at the address
            within ``CONNECT_TIMEOUT`` (one line naming it).
    """
    if address == "auto":
        from ray._private import services

        try:
            found = services.canonicalize_bootstrap_address("auto")
        except Exception as err:  # Ray raises ConnectionError when it finds none
            raise RuntimeError(f"ray_address=auto: no running Ray cluster found ({err})") from None
        if not found:
            raise RuntimeError("ray_address=auto: no running Ray cluster found")
        address = found
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT):
            pass
    except OSError as err:
        raise RuntimeError(
            f"ray_address={address}: no Ray cluster answers there ({err}); start one with "
            "'ray start --head', or leave the address out for a local cluster"
        ) from None
    return address


@contextlib.contextmanager
def ray_cluster(
    *, num_cpus: int | None = None, num_gpus: int | None = None, address: str | None = None
) -> Iterator[None]:
    """A Ray cluster for this process: the running one, else a new local one or the one at
    ``address``; the connection is shut down on exit (a cluster we did not start stays up).

    ``address`` (default ``FEDSPARSE_RAY_ADDRESS``, else ``"local"``: ``ray_address``): a
    new cluster is local (``address="local"``: never one that ``ray start`` or
    ``RAY_ADDRESS`` points at) unless an address is given; a given one must answer within
    ``CONNECT_TIMEOUT``. Either way this process keeps its SIGTERM handler (``ray.init``
    would replace it by an exit that skips the command line's clean-up).

    Args:
        num_cpus, num_gpus: the new local cluster's resources (default: what Ray detects);
            an existing cluster has its own.

    Raises:
        ValueError: a malformed address.
        RuntimeError: an address where no cluster answers (``_reachable``).
    """
    if ray.is_initialized():
        yield
        return
    where = ray_address(address)
    if where != "local":
        where = _reachable(where)
    local = where == "local"
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    with warnings.catch_warnings():  # a tip about a future default of CUDA_VISIBLE_DEVICES
        warnings.simplefilter("ignore", FutureWarning)
        ray.init(
            address=where,
            num_cpus=num_cpus if local else None,  # an existing cluster has its own
            num_gpus=num_gpus if local else None,
            include_dashboard=False if local else None,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    if main:
        signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        ray.shutdown()
