"""What this project's in-process grids share (``InProcessGrid``, ``RayGrid``): the Flower
``Grid`` calls that do not move messages, and the task identity Flower stamps messages with.

Flower's own grids get the identity from its runtimes; a grid that runs the ServerApp loop in
this process sets it once (run 1, task 1, the SuperLink's node id) where it is not set yet.

Each counts which runner trained the train messages it answered (``count_runners``), for the
round's ``runners`` record (``take_runners``, ``common/wire/run_log.py: RUNNERS``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import Message, MessageType, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

__all__ = ["LocalGrid", "default_node_ids", "trained"]


def default_node_ids(node_ids: Iterable[int] | None, num_nodes: int) -> list[int]:
    """``node_ids`` as a list, or the default 1001, 1002, ... for ``num_nodes`` nodes."""
    return list(node_ids) if node_ids is not None else [1001 + i for i in range(num_nodes)]


def trained(message: Message, reply: Message) -> bool:
    """Whether ``reply`` answers train message ``message`` with content (a round trained)."""
    return message.metadata.message_type == MessageType.TRAIN and not reply.has_error()


class LocalGrid(Grid):
    """A ``Grid`` whose nodes are ``_node_list()``; subclasses move the messages."""

    def __init__(self) -> None:
        self._runners: Counter[str] = Counter()
        for attr, value in (("run_id", 1), ("task_id", 1), ("node_id", SUPERLINK_NODE_ID)):
            try:
                getattr(TaskIdentity, attr)
            except RuntimeError:
                setattr(TaskIdentity, attr, value)

    def _node_list(self) -> list[int]:
        raise NotImplementedError

    def count_runners(self, counts: Mapping[str, int]) -> None:
        """Adds ``{runner: trained messages}`` to the counts ``take_runners`` returns."""
        self._runners.update(counts)

    def take_runners(self) -> dict[str, int]:
        """The runners of the train messages answered since the last call (``{runner:
        count}``, sorted; empty: none trained), and a fresh count."""
        counts, self._runners = dict(sorted(self._runners.items())), Counter()
        return counts

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
        return self._node_list()

    def get_nodes(self) -> Iterable[Any]:  # noqa: D102
        return self._node_list()
