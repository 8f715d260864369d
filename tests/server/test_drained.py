"""The server takes a round's replies one at a time and lets each go before the next
(``server/loop.py: drained``): a round of N dense updates is not held twice, as received and
as decoded, while it is validated."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

from fedsparse.server.loop import drained


class _Reply:
    """A stand-in reply: only its identity and lifetime matter here."""


def test_each_reply_comes_in_order_and_is_let_go_when_the_next_is_taken() -> None:
    replies = [_Reply() for _ in range(5)]
    refs = [weakref.ref(r) for r in replies]
    taken = drained(replies)
    del replies  # as run_federated passes the grid's list: no other reference
    for i, reply in enumerate(taken):
        gc.collect()
        assert reply is refs[i]()  # the grid's order
        assert [ref() is None for ref in refs[:i]] == [True] * i  # the earlier ones: gone
        assert all(ref() is not None for ref in refs[i:])  # the later ones: still queued
    del reply
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_a_streamed_round_is_read_as_it_streams_and_an_empty_one_is_empty() -> None:
    """``RayGrid`` streams a round's replies as its workers finish: each is taken as it
    comes, none gathered first (the server decodes while later ones train)."""
    events: list[str] = []
    replies = [_Reply(), _Reply(), _Reply()]

    def stream() -> Iterator[_Reply]:
        for i, reply in enumerate(replies):
            events.append(f"received {i}")
            yield reply

    for i, reply in enumerate(drained(stream())):
        assert reply is replies[i]
        events.append(f"validated {i}")
    assert events == [f"{what} {i}" for i in range(3) for what in ("received", "validated")]
    assert list(drained([])) == [] and list(drained(iter([]))) == []
