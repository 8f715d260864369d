"""``PopulationGrid`` answers a round's train messages together: each node's reply is what
``InProcessGrid`` (the ClientApp, one message at a time) gives it, to float32 rounding, and a
malformed message gets the ClientApp's error reply without touching the others."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import pytest
import torch
from flwr.app import Context, Message, RecordDict

from fedsparse.client.app import app as client_app
from fedsparse.common.wire.protocol import CONFIG_RECORD
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.lab.simulation.population import PopulationGrid
from fedsparse.server.messages import train_message
from tests.client.node_helpers import cfg, first_task, parse, weights

NODES = (1001, 1002, 1003)


def _ask(
    grid_class: type[InProcessGrid], *, broken: int | None = None
) -> tuple[list[Message], list[Message]]:
    """(the round's messages, the replies)."""
    run = cfg(target_epsilon=0.0, noise_multiplier=1.0, seed=3, schedule="constant")
    grid = grid_class(
        client_app, num_nodes=len(NODES), run_config=run.to_run_config(), node_ids=NODES
    )
    task = first_task(run, weights(run))
    messages = [train_message(task, node=node) for node in NODES]
    if broken is not None:  # the instruction without its batch size
        del messages[broken].content.config_records[CONFIG_RECORD]["batch-size"]
    return messages, in_order(messages, grid.send_and_receive(messages))


def in_order(messages: list[Message], replies) -> list[Message]:  # type: ignore[no-untyped-def]
    """The replies in their messages' order (a grid streams them as they are ready); one
    each, to a message sent."""
    by_id = {r.metadata.reply_to_message_id: r for r in replies}
    assert sorted(by_id) == sorted(m.metadata.message_id for m in messages)
    return [by_id[m.metadata.message_id] for m in messages]


def test_each_node_gets_the_client_apps_reply_and_a_bad_message_only_its_error() -> None:
    _, alone = _ask(InProcessGrid)
    sent, together = _ask(PopulationGrid, broken=1)
    assert [m.metadata.reply_to_message_id for m in together] == [  # one a message
        m.metadata.message_id for m in sent
    ]
    assert together[1].has_error() and "batch-size" in together[1].error.reason
    for i in (0, 2):
        (ours, dense), (theirs, reference) = parse(together[i]), parse(alone[i])
        assert dataclasses.replace(ours, update=b"", train_loss=0.0) == dataclasses.replace(
            theirs, update=b"", train_loss=0.0
        )  # every count, epsilon, sigma and keep
        assert ours.train_loss == pytest.approx(theirs.train_loss, rel=1e-5)
        assert len(ours.update) == len(theirs.update)
        scale = float(reference.abs().max())
        torch.testing.assert_close(dense, reference, rtol=0, atol=1e-4 * scale)


def test_a_second_message_to_a_node_in_one_pull_sees_the_first_finished() -> None:
    """As the ClientApp one message at a time: the node's state after the first round, so
    its check (a later round than its last) refuses the repeat, and one round is charged."""
    run = cfg(target_epsilon=0.0, noise_multiplier=1.0, seed=3, schedule="constant")
    grid = PopulationGrid(
        client_app, num_nodes=len(NODES), run_config=run.to_run_config(), node_ids=NODES
    )
    task = first_task(run, weights(run))
    messages = [train_message(task, node=NODES[0]) for _ in range(2)]
    messages.append(train_message(task, node=NODES[1]))
    replies = list(grid.send_and_receive(messages))
    assert len(replies) == 3
    first, other = (
        next(r for r in replies if r is not None and _to(r, m)) for m in (messages[0], messages[2])
    )
    repeat = next(r for r in replies if _to(r, messages[1]))
    assert not first.has_error() and not other.has_error()
    assert repeat.has_error() and "already trained round 1" in repeat.error.reason
    reference = _ask(InProcessGrid)[1][0]
    assert parse(first)[0].epsilon == parse(reference)[0].epsilon  # one round's epsilon


def _to(reply: Message, message: Message) -> bool:
    return reply.metadata.reply_to_message_id == message.metadata.message_id


def test_a_vectorised_ray_worker_answers_as_the_population_grid_does() -> None:
    """``VirtualClients(vectorised=True)`` (a Ray worker's clients, tested without Ray)
    answers its share of a round together: the ClientApp's replies to float32 rounding, a bad
    message its own error, and an overridden node through its override."""
    from fedsparse.client.node_policy import SIMULATION_NODE_POLICY
    from fedsparse.lab.simulation.rayworkers import VirtualClients

    run = cfg(target_epsilon=0.0, noise_multiplier=1.0, seed=3, schedule="constant")
    sent, alone = _ask(InProcessGrid)
    worker = VirtualClients(client_app, vectorised=True)
    calls: list[int] = []

    def override(msg: Message, context: object) -> Message:
        calls.append(msg.metadata.dst_node_id)
        return client_app(msg, context)  # type: ignore[arg-type]

    worker.assign(
        run_id=1,
        nodes=[(node, i) for i, node in enumerate(NODES)],
        num_partitions=len(NODES),
        node_config=SIMULATION_NODE_POLICY,
        run_config=run.to_run_config(),
        overrides={NODES[2]: override},
    )
    task = first_task(run, weights(run))
    messages = [train_message(task, node=node) for node in NODES]
    del messages[1].content.config_records[CONFIG_RECORD]["batch-size"]
    replies, runners = worker.handle_counted(messages)
    assert calls == [NODES[2]]  # the override alone; the others in the batch
    assert runners == {"vectorised": 1, "client-app": 1}  # the error reply trained nothing
    assert replies[1].has_error() and "batch-size" in replies[1].error.reason
    for i in (0, 2):
        (ours, dense), (theirs, reference) = parse(replies[i]), parse(alone[i])
        assert ours.epsilon == theirs.epsilon and len(ours.update) == len(theirs.update)
        scale = float(reference.abs().max())
        torch.testing.assert_close(dense, reference, rtol=0, atol=1e-4 * scale)
    assert (worker.stats().messages, worker.stats().together) == (3, 2)


def test_a_deadline_passing_while_a_round_trains_keeps_the_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The deadline is checked before a round, not after it: replies already trained (their
    # ledger charged, their state saved) are delivered; the next pull is refused.
    from fedsparse.lab.simulation import population

    run = cfg(target_epsilon=0.0, noise_multiplier=1.0, seed=3, schedule="constant")
    grid = PopulationGrid(
        client_app,
        num_nodes=len(NODES),
        run_config=run.to_run_config(),
        node_ids=NODES,
        stop_at=time.monotonic() + 600,
    )
    real = population.train_together_each

    def late(*args, **kwargs):  # the deadline passes while the round trains
        grid._stop_at = time.monotonic() - 1.0
        return real(*args, **kwargs)

    monkeypatch.setattr(population, "train_together_each", late)
    task = first_task(run, weights(run))
    replies = list(grid.send_and_receive([train_message(task, node=node) for node in NODES]))
    assert len(replies) == len(NODES) and not any(r.has_error() for r in replies)
    with pytest.raises(TimeoutError, match="deadline passed"):
        grid.send_and_receive([train_message(task, node=NODES[0])])


def test_the_grids_count_what_trained_each_answered_message() -> None:
    """``take_runners``: the population grid's batch by its runner (the vectorised step, or
    ``client_round`` for a method it does not vectorise), an override as a ClientApp, an error
    reply not at all; each call starts a fresh count."""
    run = cfg(target_epsilon=0.0, noise_multiplier=1.0, seed=3, schedule="constant")
    grids = {
        "rs": PopulationGrid(
            client_app,
            num_nodes=len(NODES),
            run_config=run.to_run_config(),
            node_ids=NODES,
            overrides={NODES[2]: client_app},
        ),
        "random-k": PopulationGrid(
            client_app,
            num_nodes=len(NODES),
            run_config=dataclasses.replace(run, method="random-k").to_run_config(),
            node_ids=NODES,
        ),
        "in-process": InProcessGrid(
            client_app, num_nodes=len(NODES), run_config=run.to_run_config(), node_ids=NODES
        ),
    }
    task = first_task(run, weights(run))
    counts = {}
    for name, grid in grids.items():
        messages = [train_message(task, node=node) for node in NODES]
        del messages[1].content.config_records[CONFIG_RECORD]["batch-size"]
        replies = in_order(messages, grid.send_and_receive(messages))
        assert [r.has_error() for r in replies] == [False, True, False], name
        counts[name] = grid.take_runners()
        assert grid.take_runners() == {}
    assert counts == {
        "rs": {"client-app": 1, "vectorised": 1},
        "random-k": {"client-round": 2},
        "in-process": {"client-app": 2},
    }


def test_a_pulls_replies_stream_chunk_by_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk a client: the first reply is handed on when the first chunk has trained,
    before the others train (the server adds it and lets it go), and the runners are counted
    once the replies are read to the end."""
    from fedsparse.client import population as rounds

    monkeypatch.setattr(rounds, "CHUNK_BYTES", 1)
    trained: list[int] = []
    real = rounds.train_chunk

    def counting(chunk, *args, **kwargs):  # type: ignore[no-untyped-def]
        trained.append(len(chunk))
        return real(chunk, *args, **kwargs)

    monkeypatch.setattr(rounds, "train_chunk", counting)
    run = cfg(target_epsilon=0.0, noise_multiplier=1.0, seed=3, schedule="constant")
    grid = PopulationGrid(
        client_app, num_nodes=len(NODES), run_config=run.to_run_config(), node_ids=NODES
    )
    task = first_task(run, weights(run))
    messages = [train_message(task, node=node) for node in NODES]
    replies = iter(grid.send_and_receive(messages))
    first = next(replies)
    assert trained == [1] and not first.has_error()
    rest = list(replies)
    assert trained == [1, 1, 1] and len(rest) == 2
    assert grid.take_runners() == {"vectorised": 3}
    _, alone = _ask(InProcessGrid)
    streamed = in_order(messages, [first, *rest])
    for ours, theirs in zip(streamed, alone, strict=True):
        assert parse(ours)[0].epsilon == parse(theirs)[0].epsilon


def test_a_batch_failing_midway_answers_the_rest_with_its_error_and_counts_the_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replies handed on before the failure stay, counted; each other message gets the
    error, none twice."""
    from fedsparse.lab.simulation import population

    run = cfg(target_epsilon=0.0, noise_multiplier=1.0, seed=3, schedule="constant")
    task = first_task(run, weights(run))
    messages = [train_message(task, node=node) for node in NODES]
    contexts = {
        n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
        for n in NODES
    }
    sentinel = Message(RecordDict(), reply_to=messages[0])

    def failing(batch, *, runners):  # type: ignore[no-untyped-def]
        runners["vectorised"] += 1
        yield 0, sentinel
        raise RuntimeError("the batch broke")

    monkeypatch.setattr(population, "train_population_each", failing)
    counts: Counter[str] = Counter()
    got = list(population.train_together_each(messages, contexts, runners=counts))
    assert [i for i, _ in got] == [0, 1, 2] and got[0][1] is sentinel
    assert all(r.has_error() and "the batch broke" in r.error.reason for _, r in got[1:])
    assert counts == {"vectorised": 1}
