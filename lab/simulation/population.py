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

The rounds equal ``inprocess``'s to float32 rounding, not bit for bit (the vectorised step
sums in other orders: ``client/population.py``), so a run started on one resumes only on the
same backend family (``lab/launch/run_dir.py``). The vectorised step runs on every CPU this
process may use (``torch.set_num_threads``), the ClientApp's steps on one as elsewhere.
"""

from __future__ import annotations

import importlib
import os
from collections import Counter
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any

import torch
from flwr.app import Context, Message, MessageType

from fedsparse.client.app import app as fedsparse_app
from fedsparse.client.train_batch import error_reply, train_population
from fedsparse.lab.simulation.inprocess import InProcessGrid

__all__ = ["PopulationGrid", "batched", "train_together", "warm_up"]


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
    """``train_population``'s replies to train messages to nodes of ``contexts`` (a node's
    second message waits for its first); a failure of the batch itself is every message's
    error reply (as the runtimes reply when the ClientApp raises), none lost.

    Args:
        threads: torch's threads for the vectorised step (None: as the process has them;
            a Ray worker's are its CPUs).
        runners: counts, when given, what trained each message answered with content
            (``train_population``).
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    counts: Counter[str] = Counter()  # kept only if the batch did not fail as a whole
    try:
        batch = [(m, contexts[m.metadata.dst_node_id]) for m in messages]
        replies = train_population(batch, runners=counts)
    except Exception as err:
        return [error_reply(m, err) for m in messages]
    finally:
        torch.set_num_threads(before)
    if runners is not None:
        runners.update(counts)
    return replies


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
        threads = self._threads or len(os.sched_getaffinity(0))
        counts: Counter[str] = Counter()
        answers = train_together(messages, self._contexts, threads=threads, runners=counts)
        self.count_runners(counts)
        answered = dict(zip(batch, answers, strict=True))
        rest = iter(self._deliver([i for i in ids if i not in answered]))  # a round under way
        return [answered[i] if i in answered else next(rest) for i in ids]


def warm_up() -> None:
    """Imports what torch.func's first grad imports (``torch._dynamo``, about a second): at
    start-up, not in round 1's time."""
    importlib.import_module("torch._dynamo")
