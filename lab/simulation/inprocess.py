"""An in-process Grid: the real ClientApp, called in this process, one Context per node.

For fast, deterministic runs of the real ServerApp loop (``run_federated``) without a
SuperLink or Ray: tests use it to compare an in-process round with the simulated and the
deployed ones, and to inject faulty clients. Messages are handed over as objects; the byte
accounting (``message_bytes``) counts them exactly as Flower would serialize them (computed
from the payload and the known framing; a test keeps it equal to the serialized size).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode

from fedsparse.client.node_policy import SIMULATION_NODE_POLICY
from fedsparse.lab.simulation.local_grid import LocalGrid, default_node_ids, trained

__all__ = ["InProcessGrid"]

ClientFn = Callable[[Message, Context], Message]


class InProcessGrid(LocalGrid):
    """Delivers each message to ``client_app`` with the destination node's ``Context``.

    Args:
        client_app: the ClientApp (or any callable with its signature).
        num_nodes: nodes ``0..num_nodes-1`` get ``partition-id`` = their index.
        run_config: the run config every node's Context carries.
        node_ids: optional explicit node ids (default 1001, 1002, ...).
        overrides: per-node replacement callables (e.g. a faulty client), by node id.
        node_config: every node's policy entries (``client/node_policy.py``); default
            ``SIMULATION_NODE_POLICY`` (seeded noise, no ledger, everything allowed and
            released); ``{"ledger-dir": ...}`` gives a deployed node's defaults.
        run_id: the run id every node's Context carries.
        stop_at: a ``time.monotonic()`` deadline for the whole run: a pull after it raises
            ``TimeoutError`` (a round under way is not cut; None: no deadline).
    """

    def __init__(
        self,
        client_app: ClientApp | ClientFn,
        *,
        num_nodes: int,
        run_config: Mapping[str, Any],
        node_ids: Iterable[int] | None = None,
        overrides: Mapping[int, ClientFn] | None = None,
        node_config: Mapping[str, Any] | None = None,
        run_id: int = 1,
        stop_at: float | None = None,
    ) -> None:
        super().__init__()
        self._stop_at = stop_at
        ids = default_node_ids(node_ids, num_nodes)
        self._client_app = client_app
        self._overrides = dict(overrides or {})
        self._contexts = {
            node: Context(
                run_id=run_id,
                node_id=node,
                node_config={
                    "partition-id": i,
                    "num-partitions": num_nodes,
                    **(SIMULATION_NODE_POLICY if node_config is None else node_config),
                },
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for i, node in enumerate(ids)
        }
        self._pending: dict[str, Message] = {}
        self._counter = itertools.count()

    def _node_list(self) -> list[int]:
        return list(self._contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        ids = []
        for msg in messages:
            if msg.metadata.dst_node_id not in self._contexts:
                raise ValueError(f"dst_node_id={msg.metadata.dst_node_id}: no such node")
            # Fixed-width ids: a reply carries its message's id, so its size must not depend
            # on how many messages this grid has sent (a resumed run starts a fresh grid).
            msg.metadata.__dict__["_message_id"] = f"{next(self._counter):012d}-{uuid4()}"
            msg.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
            self._pending[msg.metadata.message_id] = msg
            ids.append(msg.metadata.message_id)
        return ids

    def check_deadline(self) -> None:
        """Raises ``TimeoutError`` once the run's ``stop_at`` has passed."""
        if self._stop_at is not None and time.monotonic() > self._stop_at:
            raise TimeoutError("the run's deadline passed before a round's replies were pulled")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        self.check_deadline()
        return self._deliver(message_ids)

    def _deliver(self, message_ids: Iterable[str]) -> list[Message]:
        """Each pending message's reply from its node's handler, in order (no deadline: a
        pull checked it before the round began)."""
        replies = []
        for message_id in message_ids:
            msg = self._pending.pop(message_id)
            node = msg.metadata.dst_node_id
            handler = self._overrides.get(node, self._client_app)
            try:
                reply = handler(msg, self._contexts[node])
            except Exception as err:  # the real runtimes turn exceptions into error replies
                reply = Message(
                    Error(
                        code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                        reason=f"{type(err).__name__}: {err}",
                    ),
                    reply_to=msg,
                )
            if trained(msg, reply):
                self._runners["client-app"] += 1
            replies.append(reply)
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:  # noqa: D102
        return self.pull_messages(self.push_messages(messages))
