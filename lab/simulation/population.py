"""The population backend: ``InProcessGrid`` whose train messages of a round are answered
together (``client/train_batch.py: train_population``).

Every message is prepared and finished by the ClientApp's own steps (checks, calibration,
ledger, node state, reply) and the rounds in between run in one ``population_round``: the
clients' DP-SGD steps vectorised across them where ``population_error`` allows, else each
client's ``client_round``. Other messages (evaluation, secure aggregation's stages) and nodes
with an override go to the ClientApp one at a time, as ``InProcessGrid`` sends them, and so
does every message when the grid was given another ClientApp than fedsparse's. Ray workers
answer their share of a round the same way when made with ``vectorised=True``
(``rayworkers.VirtualClients``: ``batched``, ``train_together``).

A pull's replies stream: each is handed on as it is finished, chunk by chunk, and the server
adds its update as it reads it (``server/round_updates.py``: exact sums, so their order does
not matter), so a round holds a chunk of clients' state and updates, not every node's.

The rounds equal ``inprocess``'s to float32 rounding, not bit for bit (the vectorised step
sums in other orders: ``client/population.py``), so a run started on one resumes only on the
same backend family (``lab/launch/run_dir.py``). The vectorised step runs on every CPU this
process may use (``torch.set_num_threads``), the ClientApp's steps on one as elsewhere.
"""

from __future__ import annotations

import importlib
import os
from collections import Counter
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from flwr.app import Context, Message, MessageType

from fedsparse.client.app import app as fedsparse_app
from fedsparse.client.train_batch import error_reply, train_population_each
from fedsparse.lab.simulation.inprocess import InProcessGrid

__all__ = ["PopulationGrid", "batched", "train_together", "train_together_each", "warm_up"]


def batched(message: Message, overrides: Container[int]) -> bool:
    """Whether ``message`` is answered in a batch: a train message to a node without an
    override (others go to the ClientApp one at a time)."""
    metadata = message.metadata
    return metadata.message_type == MessageType.TRAIN and metadata.dst_node_id not in overrides


def train_together(
    messages: Sequence[Message],
    contexts: Mapping[int, Context],
    *,
    threads: int | None = None,
    runners: Counter[str] | None = None,
) -> list[Message]:
    """``train_together_each``'s replies in the messages' order."""
    replies = dict(train_together_each(messages, contexts, threads=threads, runners=runners))
    return [replies[i] for i in range(len(messages))]


def train_together_each(
    messages: Sequence[Message],
    contexts: Mapping[int, Context],
    *,
    threads: int | None = None,
    runners: Counter[str] | None = None,
) -> Iterator[tuple[int, Message]]:
    """``train_population_each``'s replies to train messages to nodes of ``contexts`` as each
    is ready, ``(index in messages, reply)`` (a node's second message waits for its first);
    a failure of the batch itself is the error reply of every message not yet answered (as
    the runtimes reply when the ClientApp raises), none lost.

    Args:
        threads: torch's threads for the vectorised step (None: as the process has them;
            a Ray worker's are its CPUs).
        runners: counts, when given, what trained each message answered with content
            (``train_population_each``), once the replies are read to the end (or the
            stream is closed).
    """
    before = torch.get_num_threads()
    counts: Counter[str] = Counter()
    answered: set[int] = set()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        batch = [(m, contexts[m.metadata.dst_node_id]) for m in messages]
        for i, reply in train_population_each(batch, runners=counts):
            answered.add(i)
            yield i, reply
    except Exception as err:
        for i, message in enumerate(messages):
            if i not in answered:
                yield i, error_reply(message, err)
    finally:
        torch.set_num_threads(before)
        if runners is not None:  # what trained the replies handed on before any failure
            runners.update(counts)


class PopulationGrid(InProcessGrid):
    """``InProcessGrid`` (same arguments) answering a pull's train messages in one batch.

    Args:
        threads: torch's threads for the vectorised step; None: every CPU this process may
            use (a sweep running several jobs gives each its share).
    """

    def __init__(self, *args: Any, threads: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if threads is not None and threads < 1:
            raise ValueError(f"threads={threads}: expected >= 1")
        self._threads = threads
        warm_up()

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        ids = list(message_ids)
        self.check_deadline()
        if self._client_app is not fedsparse_app:  # another app: one message at a time
            return self._deliver(ids)
        batch = [i for i in ids if batched(self._pending[i], self._overrides)]
        messages = [self._pending.pop(message_id) for message_id in batch]
        taken = set(batch)
        rest = [i for i in ids if i not in taken]
        return self._stream(messages, rest)

    def _stream(self, messages: list[Message], rest: list[str]) -> Iterator[Message]:
        """The batch's replies as each is finished (the caller adds each update and lets it
        go: a round holds a chunk's, not every node's), then the others' (a round under
        way: evaluation, secure aggregation's stages, overridden nodes) one at a time."""
        threads = self._threads or len(os.sched_getaffinity(0))
        counts: Counter[str] = Counter()
        for _, reply in train_together_each(
            messages, self._contexts, threads=threads, runners=counts
        ):
            yield reply
        self.count_runners(counts)
        yield from self._deliver(rest)


def warm_up() -> None:
    """Imports what torch.func's first grad imports (``torch._dynamo``, about a second): at
    start-up, not in round 1's time."""
    importlib.import_module("torch._dynamo")
