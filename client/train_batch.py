"""Many train messages at once: ``train_population``, the ClientApp's ``train`` for a batch.

For a runner that holds many simulated nodes in one process (``lab/simulation/population.py``,
the ``population`` backend): each message is prepared and finished exactly as the ClientApp
prepares and finishes it (``client/train_message.py``), and the rounds in between run together
(``client/population.py: population_rounds``), each reply handed on as it is finished
(``train_population_each``). ``runners`` counts what trained each message
that got a reply with content: ``vectorised`` or ``client-round`` (``RoundLog.runners``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

import torch
from flwr.app import Context, Error, Message
from flwr.common.constant import ErrorCode
from torch import nn

from fedsparse.client.guard import released_error
from fedsparse.client.local_round import RoundResult
from fedsparse.client.population import population_error, population_rounds
from fedsparse.client.train_message import PreparedTrain, finish_train, prepare_train, run_alone

__all__ = ["error_reply", "train_population", "train_population_each"]


def train_population(
    batch: Sequence[tuple[Message, Context]], *, runners: Counter[str] | None = None
) -> list[Message]:
    """``train``'s replies to a batch of train messages, in the batch's order
    (``train_population_each``, gathered)."""
    replies = dict(train_population_each(batch, runners=runners))
    return [replies[i] for i in range(len(batch))]


def train_population_each(
    batch: Sequence[tuple[Message, Context]], *, runners: Counter[str] | None = None
) -> Iterator[tuple[int, Message]]:
    """``train``'s reply to each of a batch of train messages as it is ready, ``(index in
    batch, reply)``, the nodes' rounds run together by ``population_rounds`` (the vectorised
    step where it applies, ``client_round`` where not): a round's replies are not all held.

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
    for j, reply in _train_once([batch[i] for i in first], counts):
        yield first[j], reply
    if later:
        for j, reply in train_population_each([batch[i] for i in later], runners=counts):
            yield later[j], reply


def _train_once(
    batch: Sequence[tuple[Message, Context]], runners: Counter[str]
) -> Iterator[tuple[int, Message]]:
    """``train_population_each`` for messages to distinct nodes."""
    threads = torch.get_num_threads()  # the vectorised step's; preparing and finishing take one
    prepared: dict[int, PreparedTrain] = {}
    for i, (msg, context) in enumerate(batch):
        try:
            ready = prepare_train(msg, context)
        except Exception as err:
            yield i, error_reply(msg, err)
            continue
        if ready.secagg is not None:
            reply = _finish_alone(ready)
            if not reply.has_error():
                runners["client-round"] += 1
            yield i, reply
        else:
            prepared[i] = ready
    models = {id(ready.reusable): ready.reusable for ready in prepared.values()}
    try:
        for key, reusable in models.items():  # one run: one process model
            group = [(i, ready) for i, ready in prepared.items() if id(ready.reusable) == key]
            torch.set_num_threads(threads)
            results = population_rounds([r.call for _, r in group], model=reusable.model)
            while True:
                with reusable.lock:  # held while a result is computed, not across a yield
                    torch.set_num_threads(threads)
                    item = next(results, None)
                if item is None:
                    break
                i, ready = group[item[0]]
                torch.set_num_threads(1)  # finishing a message: one thread, as the app's
                yield i, _finished(ready, item[1], reusable.model, runners)
    finally:
        torch.set_num_threads(threads)


def _finished(
    ready: PreparedTrain, result: RoundResult | Exception, model: nn.Module, runners: Counter[str]
) -> Message:
    """The reply to a prepared message from its round's result (or the error reply)."""
    if isinstance(result, Exception):  # as train: one fixed error, named nothing
        return error_reply(ready.msg, released_error(result, data_read=True))
    try:
        reply = finish_train(ready, result)
    except Exception as err:
        return error_reply(ready.msg, err)
    vectorised = population_error(ready.call, model) is None
    runners["vectorised" if vectorised else "client-round"] += 1
    return reply


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
