"""Many train messages at once: ``train_population``, the ClientApp's ``train`` for a batch.

For a runner that holds many simulated nodes in one process (``lab/simulation/population.py``,
the ``population`` backend): each message is prepared and finished exactly as the ClientApp
prepares and finishes it (``client/train_message.py``), and the rounds in between run together
(``client/population.py: population_round``). ``runners`` counts what trained each message
that got a reply with content: ``vectorised`` or ``client-round`` (``RoundLog.runners``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from flwr.app import Context, Error, Message
from flwr.common.constant import ErrorCode

from fedsparse.client.guard import released_error
from fedsparse.client.population import population_error, population_round_settled
from fedsparse.client.train_message import PreparedTrain, finish_train, prepare_train, run_alone

__all__ = ["error_reply", "train_population"]


def train_population(
    batch: Sequence[tuple[Message, Context]], *, runners: Counter[str] | None = None
) -> list[Message]:
    """``train``'s replies to a batch of train messages, the nodes' rounds run together by
    ``population_round`` (the vectorised step where it applies, ``client_round`` where not).

    Each message is prepared and finished as ``train`` does (the same checks, calibration,
    ledger charge and state); a message whose preparation or finishing raises gets the error
    reply Flower's runtimes give (``error_reply``), the others are unaffected. With secure
    aggregation every node trains alone (``train``): its masking stages follow. A second
    message to a node already in the batch waits for the first to be finished (its state
    saved), as the ClientApp would take them one after the other: the node's checks (a round
    after its last one) and its accountant history see the first.
    """
    first: list[int] = []
    later: list[int] = []
    seen: set[int] = set()
    for i, (_, context) in enumerate(batch):
        (later if id(context) in seen else first).append(i)
        seen.add(id(context))
    counts: Counter[str] = Counter() if runners is None else runners
    replies = dict(zip(first, _train_once([batch[i] for i in first], counts), strict=True))
    if later:
        again = train_population([batch[i] for i in later], runners=counts)
        replies |= dict(zip(later, again, strict=True))
    return [replies[i] for i in range(len(batch))]


def _train_once(batch: Sequence[tuple[Message, Context]], runners: Counter[str]) -> list[Message]:
    """``train_population`` for messages to distinct nodes."""
    threads = torch.get_num_threads()  # the vectorised step's; preparing and finishing take one
    replies: list[Message | None] = [None] * len(batch)
    prepared: dict[int, PreparedTrain] = {}
    for i, (msg, context) in enumerate(batch):
        try:
            ready = prepare_train(msg, context)
        except Exception as err:
            replies[i] = error_reply(msg, err)
            continue
        if ready.secagg is not None:
            reply = replies[i] = _finish_alone(ready)
            if not reply.has_error():
                runners["client-round"] += 1
        else:
            prepared[i] = ready
    models = {id(ready.reusable): ready.reusable for ready in prepared.values()}
    for key, reusable in models.items():  # one run: one process model
        group = {i: ready for i, ready in prepared.items() if id(ready.reusable) == key}
        with reusable.lock:
            torch.set_num_threads(threads)
            results = population_round_settled(
                [ready.call for ready in group.values()], model=reusable.model
            )
        torch.set_num_threads(1)  # finishing a message: one thread, as the ClientApp's
        for (i, ready), result in zip(group.items(), results, strict=True):
            if isinstance(result, Exception):  # as train: one fixed error, named nothing
                replies[i] = error_reply(ready.msg, released_error(result, data_read=True))
                continue
            try:
                replies[i] = finish_train(ready, result)
            except Exception as err:
                replies[i] = error_reply(ready.msg, err)
                continue
            vectorised = population_error(ready.call, reusable.model) is None
            runners["vectorised" if vectorised else "client-round"] += 1
    torch.set_num_threads(threads)
    assert all(r is not None for r in replies)
    return replies  # type: ignore[return-value]


def _finish_alone(ready: PreparedTrain) -> Message:
    """``train``'s reply for a prepared message, trained alone (or the error reply)."""
    try:
        return finish_train(ready, run_alone(ready))
    except Exception as err:
        return error_reply(ready.msg, err)


def error_reply(msg: Message, err: BaseException) -> Message:
    """The reply Flower's runtimes give when the ClientApp raises: an error, no content."""
    reason = f"{type(err).__name__}: {err}"
    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)
