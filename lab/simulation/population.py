"""The population backend: ``InProcessGrid`` whose train messages of a round are answered
together (``client/train_batch.py: train_population``).

Every message is prepared and finished by the ClientApp's own steps (checks, calibration,
ledger, node state, reply) and the rounds in between run in one ``population_round``: the
clients' DP-SGD steps vectorised across them where ``population_error`` allows, else each
client's ``client_round``. Other messages (evaluation, secure aggregation's stages) and nodes
with an override go to the ClientApp one at a time, as ``InProcessGrid`` sends them, and so
does every message when the grid was given another ClientApp than fedsparse's.

The rounds equal ``inprocess``'s to float32 rounding, not bit for bit (the vectorised step
sums in other orders: ``client/population.py``), so a run started on one resumes only on the
same backend family (``lab/launch/run_dir.py``). The vectorised step runs on every CPU this
process may use (``torch.set_num_threads``), the ClientApp's steps on one as elsewhere.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from typing import Any

import torch
from flwr.app import Message, MessageType

from fedsparse.client.app import app as fedsparse_app
from fedsparse.client.train_batch import error_reply, train_population
from fedsparse.lab.simulation.inprocess import InProcessGrid

__all__ = ["PopulationGrid"]


class PopulationGrid(InProcessGrid):
    """``InProcessGrid`` (same arguments) answering a pull's train messages in one batch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # torch.func's first grad imports torch._dynamo (about a second): at start-up, not in
        # round 1's time
        importlib.import_module("torch._dynamo")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        ids = list(message_ids)
        if self._client_app is not fedsparse_app:  # another app: one message at a time
            return super().pull_messages(ids)
        batched = [
            message_id
            for message_id in ids
            if self._pending[message_id].metadata.message_type == MessageType.TRAIN
            and self._pending[message_id].metadata.dst_node_id not in self._overrides
        ]
        messages = [self._pending.pop(message_id) for message_id in batched]
        threads = torch.get_num_threads()
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        try:
            answers = train_population(
                [(msg, self._contexts[msg.metadata.dst_node_id]) for msg in messages]
            )
        except Exception as err:  # as InProcessGrid: the runtime's error reply, none lost
            answers = [error_reply(msg, err) for msg in messages]
        finally:
            torch.set_num_threads(threads)
        answered = dict(zip(batched, answers, strict=True))
        rest = iter(super().pull_messages([i for i in ids if i not in answered]))
        return [answered[i] if i in answered else next(rest) for i in ids]
