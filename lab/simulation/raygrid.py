"""A Grid for large populations: many virtual clients per Ray worker, one Ray task a round each.

Flower's simulation engine sends every message to a Ray actor of its own and keeps each node's
``Context`` in the driver, shipping it to the actor and back with every message: at thousands
of clients the per-message scheduling and the Context round trips dominate. ``RayGrid`` keeps
the same ServerApp loop (``run_federated``) and the same ClientApp, and moves the work the way
pfl-research does (each worker process trains many users per task):

* a fixed set of Ray actors (``RayWorkers``, by default one per CPU of the cluster; with
  ``gpus_per_client`` a fractional GPU each) lives for the whole run, or a whole sweep;
* every virtual client lives on one worker (round robin over the node ids): its ``Context``
  (``node_config``, ``run_config``, ``state``) never leaves that worker. The dataset, its
  partitioning and the memoized accountant curves are built once per worker process
  (``client/data.py``, ``common/dp/accounting.py``); a virtual client holds only its state (its copy
  of the global model and its accountant history, ``client/state.py``);
* a round is one remote call per worker, carrying all of that worker's messages (the
  downlink payloads that nodes share are one ``bytes`` object, pickled once per call); the
  worker runs the ClientApp for each, one after the other, and returns the replies.

Equivalence: each virtual client sees what a simulated node sees (the ClientApp, a Context
with ``partition-id``/``num-partitions``, the node policy, its state) and the server
aggregates in a canonical order (``server/strategy.py``), so with the same seeds the final
model is bit-identical to the Flower simulation's (with full participation: Flower draws
random node ids, and the sampled subset depends on them) and to ``InProcessGrid``'s (same
node ids, any participation), records included (``tests/lab/test_ray_backend.py``).

Faults: a ClientApp that raises gets an error reply, as Flower's runtimes give; the round
goes on. A worker that dies (killed, out of memory) takes its virtual clients with it, as a
dead SuperNode does in a deployment: their messages get no reply (counted missing) and they
leave ``get_node_ids``. A reply later than the round's timeout is dropped.

Cluster: ``ray_cluster`` starts a local Ray cluster for this process, or reuses the one that
is running (a sweep starts one and runs every federation in it), and shuts down only what it
started.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import pickle
import resource
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

import ray
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from fedsparse.lab.launch.flower import SIMULATION_NODE_POLICY
from fedsparse.lab.launch.processes import raise_if_stopping

__all__ = [
    "RayGrid",
    "RayWorkers",
    "VirtualClients",
    "WorkerStats",
    "error_reply",
    "ray_cluster",
    "worker_count",
]

ClientFn = Callable[[Message, Context], Message]

#: Seconds between two looks at a round's tasks (a stop request is honoured in between).
POLL_SECONDS = 0.2
#: Seconds the workers get to start (a worker that needs more resources than are free waits).
START_TIMEOUT = 300.0
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

    def __init__(self, client_app: ClientApp | ClientFn) -> None:
        self._app = client_app
        self._contexts: dict[int, Context] = {}
        self._overrides: dict[int, ClientFn] = {}
        self._calls = self._messages = 0

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
        """Replaces the clients by fresh ones, a ``(node id, partition id)`` each; the pid."""
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
        self._calls = self._messages = 0
        return os.getpid()

    def handle(self, batch: Sequence[Message]) -> list[Message]:
        """Each message's reply, in order: the ClientApp with its node's ``Context``."""
        self._calls += 1
        self._messages += len(batch)
        replies = []
        for msg in batch:
            node = msg.metadata.dst_node_id
            handler = self._overrides.get(node, self._app)
            try:
                reply = handler(msg, self._contexts[node])
            except Exception as err:  # the real runtimes turn exceptions into error replies
                reply = error_reply(msg, err)
            replies.append(reply)
        return replies

    def stats(self) -> WorkerStats:
        """What this worker holds (sizes measured by pickling) and its memory."""
        rss, peak = _rss_bytes()
        peak = max(peak, rss)  # rusage's peak lags the current size by a page or so
        # Outside Ray (a test), ray.get_gpu_ids would start a cluster: ask only inside it.
        gpus = tuple(str(g) for g in ray.get_gpu_ids()) if ray.is_initialized() else ()
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
        )


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
        self._app = client_app
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
        return self._remote.remote(self._app)

    def assign(self, index: int, **kwargs: Any) -> Any:
        """``VirtualClients.assign`` on worker ``index``; a dead worker is replaced first."""
        try:
            return ray.get(self.actors[index].assign.remote(**kwargs))
        except ray.exceptions.RayActorError:
            self.actors[index] = self._start()
            return ray.get(self.actors[index].assign.remote(**kwargs))

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


@contextlib.contextmanager
def ray_cluster(*, num_cpus: int | None = None, num_gpus: int | None = None) -> Iterator[None]:
    """A local Ray cluster for this process: the running one, else a new one shut down on exit.

    A new cluster is always local (``address="local"``: never one that ``ray start`` or
    ``RAY_ADDRESS`` points at) and keeps this process's SIGTERM handler (``ray.init`` would
    replace it by an exit that skips the command line's clean-up).

    Args:
        num_cpus, num_gpus: the new cluster's resources (default: what Ray detects).
    """
    if ray.is_initialized():
        yield
        return
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    with warnings.catch_warnings():  # a tip about a future default of CUDA_VISIBLE_DEVICES
        warnings.simplefilter("ignore", FutureWarning)
        ray.init(
            address="local",
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    if main:
        signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        ray.shutdown()


@dataclass
class _Task:
    """One remote ``handle`` call: the worker it went to and the messages it carries."""

    worker: int
    messages: list[Message]


class RayGrid(Grid):
    """Delivers messages to virtual clients on ``workers``: one remote call per worker a push.

    Args:
        workers: the Ray workers; the grid assigns them its nodes (replacing what they held)
            and leaves them running (their owner closes them).
        num_nodes: nodes ``0..num_nodes-1`` get ``partition-id`` = their index.
        run_config: the run config every node's Context carries.
        node_ids: optional explicit node ids (default 1001, 1002, ...).
        overrides: per-node replacement callables (e.g. a faulty client), by node id; sent
            to the node's worker, so they must pickle (a module-level or nested function).
        node_config: every node's policy entries (``client/node_policy.py``); default
            ``SIMULATION_NODE_POLICY``.
        run_id: the run id every node's Context carries.
        stop_at: a ``time.monotonic()`` deadline for the whole run: waiting past it raises
            ``TimeoutError``.
    """

    def __init__(
        self,
        workers: RayWorkers,
        *,
        num_nodes: int,
        run_config: Mapping[str, Any],
        node_ids: Iterable[int] | None = None,
        overrides: Mapping[int, ClientFn] | None = None,
        node_config: Mapping[str, Any] | None = None,
        run_id: int = 1,
        stop_at: float | None = None,
    ) -> None:
        ids = list(node_ids) if node_ids is not None else [1001 + i for i in range(num_nodes)]
        if len(ids) != num_nodes or len(set(ids)) != num_nodes:
            raise ValueError(f"node_ids: expected {num_nodes} distinct ids, got {ids[:5]}...")
        self._workers = workers
        count = len(workers.actors)
        if count == 0:
            raise ValueError("workers: no Ray workers (closed?)")
        self._home = {node: i % count for i, node in enumerate(ids)}  # node id -> worker
        overrides = dict(overrides or {})
        policy = SIMULATION_NODE_POLICY if node_config is None else node_config
        for w in range(count):
            nodes = [(node, i) for i, node in enumerate(ids) if i % count == w]
            workers.assign(
                w,
                run_id=run_id,
                nodes=nodes,
                num_partitions=num_nodes,
                node_config=dict(policy),
                run_config=dict(run_config),
                overrides={n: fn for n, fn in overrides.items() if self._home.get(n) == w},
            )
        self._nodes = list(ids)  # the nodes still there (a dead worker's leave)
        self._stop_at = stop_at
        # Flower stamps messages with the process's task identity (set by its runtimes).
        for attr, value in (("run_id", 1), ("task_id", 1), ("node_id", SUPERLINK_NODE_ID)):
            try:
                getattr(TaskIdentity, attr)
            except RuntimeError:
                setattr(TaskIdentity, attr, value)
        self._tasks: dict[Any, _Task] = {}  # ObjectRef -> its task
        self._task_of: dict[str, Any] = {}  # message id -> ObjectRef
        self._replies: dict[str, Message] = {}  # message id -> reply (not pulled yet)
        self._counter = itertools.count()

    def set_run(self, run: Any) -> None:  # noqa: D102 - no run object in process
        self._run = run

    @property
    def run(self) -> Any:  # noqa: D102
        return getattr(self, "_run", None)

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:  # noqa: D102
        return Message(
            content=content,
            dst_node_id=dst_node_id,
            message_type=message_type,
            group_id=group_id,
            ttl=ttl,
        )

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return list(self._nodes)

    def get_nodes(self) -> Iterable[Any]:  # noqa: D102
        return list(self._nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Sends the messages: one remote call per worker, carrying all of its messages."""
        batches: dict[int, list[Message]] = {}
        ids = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            if node not in self._home:
                raise ValueError(f"dst_node_id={node}: no such node")
            # Fixed-width ids, as InProcessGrid's: a reply's size must not depend on how many
            # messages this grid has sent (the records equal InProcessGrid's byte for byte).
            msg.metadata.__dict__["_message_id"] = f"{next(self._counter):012d}-{uuid4()}"
            msg.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
            batches.setdefault(self._home[node], []).append(msg)
            ids.append(msg.metadata.message_id)
        for worker, batch in batches.items():
            ref = self._workers.actors[worker].handle.remote(batch)
            self._tasks[ref] = _Task(worker, batch)
            for msg in batch:
                self._task_of[msg.metadata.message_id] = ref
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to ``message_ids`` that have arrived (without waiting)."""
        ids = list(message_ids)
        self._wait(self._refs(ids), timeout=0.0)
        return [self._replies.pop(i) for i in ids if i in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Pushes, waits up to ``timeout`` seconds, returns the replies (late ones dropped)."""
        ids = list(self.push_messages(messages))
        self._wait(self._refs(ids), timeout=timeout)
        replies = [self._replies.pop(i) for i in ids if i in self._replies]
        for message_id in ids:  # no reply in time: forget the task (Ray frees its result)
            ref = self._task_of.pop(message_id, None)
            if ref is not None:
                self._tasks.pop(ref, None)
        return replies

    def _refs(self, message_ids: Sequence[str]) -> list[Any]:
        return list(dict.fromkeys(self._task_of[i] for i in message_ids if i in self._task_of))

    def _wait(self, refs: list[Any], *, timeout: float | None) -> None:
        """Receives the tasks of ``refs`` as they finish, until all did or ``timeout`` passed.

        Raises:
            KeyboardInterrupt: a stop was requested (``processes.request_stop``).
            TimeoutError: the run's ``stop_at`` passed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while refs:
            raise_if_stopping()
            now = time.monotonic()
            if self._stop_at is not None and now > self._stop_at:
                raise TimeoutError("the run's deadline passed while a round was running")
            left = POLL_SECONDS if deadline is None else min(POLL_SECONDS, deadline - now)
            ready, refs = ray.wait(refs, num_returns=len(refs), timeout=max(left, 0.0))
            for ref in ready:
                self._receive(ref)
            if deadline is not None and time.monotonic() >= deadline:
                return

    def _receive(self, ref: Any) -> None:
        task = self._tasks.pop(ref)
        for msg in task.messages:
            self._task_of.pop(msg.metadata.message_id, None)
        try:
            replies = ray.get(ref)
        except ray.exceptions.RayActorError as err:  # the worker died: its clients are gone
            lost = [n for n, w in self._home.items() if w == task.worker]
            self._nodes = [n for n in self._nodes if n not in set(lost)]
            log(
                logging.WARNING,
                "RayGrid: worker %d died, %d clients lost: %s",
                task.worker,
                len(lost),
                err,
            )
            return
        except ray.exceptions.RayError as err:  # the call itself failed: every message errs
            replies = [error_reply(msg, err) for msg in task.messages]
        for msg, reply in zip(task.messages, replies, strict=True):
            self._replies[msg.metadata.message_id] = reply
