"""A Grid for large populations: many virtual clients per Ray worker, one Ray task a round each.

Flower's simulation engine sends every message to a Ray actor of its own and keeps each node's
``Context`` in the driver, shipping it to the actor and back with every message: at thousands
of clients the per-message scheduling and the Context round trips dominate. ``RayGrid`` keeps
the same ServerApp loop (``run_federated``) and the same ClientApp, and moves the work the way
pfl-research does (each worker process trains many users per task):

* a fixed set of Ray actors (``RayWorkers``, ``lab/simulation/rayworkers.py``; by default one
  per CPU of the cluster; with ``gpus_per_client`` a fractional GPU each) lives for the whole
  run, or a whole sweep;
* every virtual client lives on one worker (round robin over the node ids): its ``Context``
  (``node_config``, ``run_config``, ``state``) never leaves that worker. The dataset, its
  partitioning and the memoized accountant curves are built once per worker process
  (``client/data.py``, ``common/dp/accounting.py``); a virtual client holds only its state (its copy
  of the global model and its accountant history, ``client/state.py``);
* a round is one remote call per worker, carrying all of that worker's messages (the
  downlink payloads that nodes share are one ``bytes`` object, pickled once per call); the
  worker runs the ClientApp for each, one after the other, and returns the replies. A worker
  with more than ``chunk_size`` messages gets them in calls of ``chunk_size`` (queued on the
  actor, run in order), so that no call's messages and replies, in the worker and in Ray's
  object store, outgrow a few hundred updates;
* ``send_and_receive`` yields the replies as each call's arrive, so the server validates
  and decodes a call's replies while later calls still train, and a reply's message is
  garbage as soon as it is decoded (at 10,000 dense updates the round's messages alone are
  1.5 GB).

Equivalence: each virtual client sees what a simulated node sees (the ClientApp, a Context
with ``partition-id``/``num-partitions``, the node policy, its state) and the server
sums exactly, in any order (``server/strategy.py``), so with the same seeds the final
model is bit-identical to the Flower simulation's (with full participation: Flower draws
random node ids, and the sampled subset depends on them) and to ``InProcessGrid``'s (same
node ids, any participation), records included (``tests/integration/test_ray_backend.py``).

Faults: a ClientApp that raises gets an error reply, as Flower's runtimes give; the round
goes on. A worker that dies (killed, out of memory) takes its virtual clients with it, as a
dead SuperNode does in a deployment: their messages get no reply (counted missing) and they
leave ``get_node_ids``. A reply later than the round's timeout is dropped.

Cluster: ``ray_cluster`` (``lab/simulation/rayworkers.py``) starts a local Ray cluster for
this process, or reuses the one that is running (a sweep starts one and runs every federation
in it), and shuts down only what it started.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

import ray
from flwr.app import Message
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.logger import log

from fedsparse.client.node_policy import SIMULATION_NODE_POLICY
from fedsparse.lab.launch.processes import raise_if_stopping
from fedsparse.lab.simulation.local_grid import LocalGrid, default_node_ids
from fedsparse.lab.simulation.rayworkers import ClientFn, RayWorkers, error_reply

__all__ = ["RayGrid"]

#: Seconds between two looks at a round's tasks (a stop request is honoured in between).
POLL_SECONDS = 0.2
#: The most messages one remote call carries (``RayGrid(chunk_size=...)``).
CHUNK_SIZE = 500


@dataclass
class _Task:
    """One remote ``handle`` call: the worker it went to and the messages it carries."""

    worker: int
    messages: list[Message]


class RayGrid(LocalGrid):
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
        chunk_size: the most messages one remote call carries.
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
        chunk_size: int = CHUNK_SIZE,
    ) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size}: expected >= 1")
        self._chunk = chunk_size
        super().__init__()
        ids = default_node_ids(node_ids, num_nodes)
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
        self._tasks: dict[Any, _Task] = {}  # ObjectRef -> its task
        self._task_of: dict[str, Any] = {}  # message id -> ObjectRef
        self._replies: dict[str, Message] = {}  # message id -> reply (not pulled yet)
        self._received: dict[Any, _Task] = {}  # ObjectRef -> its task, received, not yielded
        self._counter = itertools.count()

    def _node_list(self) -> list[int]:
        return list(self._nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Sends the messages: one remote call per worker and ``chunk_size`` of its messages."""
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
        for worker, messages_of in batches.items():
            for start in range(0, len(messages_of), self._chunk):
                batch = messages_of[start : start + self._chunk]
                ref = self._workers.actors[worker].handle_counted.remote(batch)
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
    ) -> Iterator[Message]:
        """Pushes now; yields the replies as their calls finish, for up to ``timeout``
        seconds from this call (late ones dropped). The messages are sent before it returns;
        the waiting happens as the caller iterates (``KeyboardInterrupt`` for a stop,
        ``TimeoutError`` past the run's deadline, raised there)."""
        ids = list(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._stream(ids, deadline)

    def _stream(self, ids: list[str], deadline: float | None) -> Iterator[Message]:
        try:
            for ref in self._arrivals(self._refs(ids), deadline=deadline):
                task = self._received.pop(ref)
                for msg in task.messages:
                    reply = self._replies.pop(msg.metadata.message_id, None)
                    if reply is not None:
                        yield reply
            for message_id in ids:  # replies received before the stream began (pulled late)
                if message_id in self._replies:
                    yield self._replies.pop(message_id)
        finally:
            self._received.clear()  # a stream left early: what it did not yield
            for message_id in ids:  # no reply in time: forget the task (Ray frees its result)
                ref = self._task_of.pop(message_id, None)
                if ref is not None:
                    self._tasks.pop(ref, None)

    def _refs(self, message_ids: Sequence[str]) -> list[Any]:
        return list(dict.fromkeys(self._task_of[i] for i in message_ids if i in self._task_of))

    def _wait(self, refs: list[Any], *, timeout: float | None) -> None:
        """Receives the tasks of ``refs`` as they finish, until all did or ``timeout`` passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for ref in self._arrivals(refs, deadline=deadline):
            self._received.pop(ref, None)

    def _arrivals(self, refs: list[Any], *, deadline: float | None) -> Iterator[Any]:
        """Receives the tasks of ``refs`` as they finish, yielding each one's ref once its
        replies are in ``_replies``, until all did or ``deadline`` passed.

        Raises:
            KeyboardInterrupt: a stop was requested (``processes.request_stop``).
            TimeoutError: the run's ``stop_at`` passed.
        """
        while refs:
            raise_if_stopping()
            now = time.monotonic()
            if self._stop_at is not None and now > self._stop_at:
                raise TimeoutError("the run's deadline passed while a round was running")
            left = POLL_SECONDS if deadline is None else min(POLL_SECONDS, deadline - now)
            ready, refs = ray.wait(refs, num_returns=len(refs), timeout=max(left, 0.0))
            for ref in ready:
                self._receive(ref)
                yield ref
            if deadline is not None and time.monotonic() >= deadline:
                return

    def _receive(self, ref: Any) -> None:
        task = self._tasks.pop(ref)
        self._received[ref] = task
        for msg in task.messages:
            self._task_of.pop(msg.metadata.message_id, None)
        try:
            replies, runners = ray.get(ref)
            self.count_runners(runners)
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
