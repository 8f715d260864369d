"""The round's downlink cache sends exactly what the per-node path sends, encoding far less."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message

from fedsparse.common import masks
from fedsparse.common.config import FederatedConfig
from fedsparse.common.wire.protocol import CONFIG_RECORD, TrainInstruction
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server import downlink
from fedsparse.server.downlink import DownlinkCache
from fedsparse.server.strategy import SparseFedAvg, flat_array, flat_tensor

D = 3000
NODES = 12
FAILING = (1003, 1007, 1011)  # error the second time selected: dense when next selected


def _per_node(cache: DownlinkCache) -> None:
    """Makes ``cache`` take the uncached path: ``payload`` once per node."""

    def payloads(nodes, weights, *, version, server_round):  # type: ignore[no-untyped-def]
        return {
            n: cache.payload(n, weights, version=version, server_round=server_round) for n in nodes
        }

    cache.payloads = payloads  # type: ignore[method-assign]


def _failing_second_time(client: Callable[[Message, Context], Message]):  # type: ignore[no-untyped-def]
    calls = []

    def handler(msg: Message, context: Context) -> Message:
        calls.append(msg)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return client(msg, context)

    return handler


@pytest.mark.parametrize(
    ("codec", "compression", "mask_scope"),
    [
        ("values", "none", "round"),
        ("values", "zstd", "round"),
        ("delta", "none", "round"),
        ("auto", "none", "client"),
        ("bitmap", "zstd", "client"),
    ],
)
def test_cached_messages_equal_the_per_node_path_in_mixed_states(
    make_synthetic_client, codec: str, compression: str, mask_scope: str
) -> None:
    """8 rounds, 12 nodes, 7 a round: fresh, one and two (or more) behind, and failed nodes."""
    cfg = FederatedConfig(
        num_rounds=8,
        final_rate=0.6,
        clients_per_round=7,
        codec=codec,
        compression=compression,
        mask_scope=mask_scope,
        seed=11,
    )
    client = make_synthetic_client(cfg, D)
    grid = InProcessGrid(
        client,
        num_nodes=NODES,
        run_config=cfg.to_run_config(),
        overrides={node: _failing_second_time(client) for node in FAILING},
    )
    cached = SparseFedAvg(cfg, num_parameters=D)
    reference = SparseFedAvg(cfg, num_parameters=D)
    _per_node(reference.downlink)
    arrays = flat_array(torch.randn(D, generator=torch.Generator().manual_seed(0)))
    gaps: set[str] = set()
    errored: set[int] = set()
    for server_round in range(1, cfg.num_rounds + 1):
        held = dict(cached.downlink.versions)
        ours = list(cached.configure_train(server_round, arrays, ConfigRecord(), grid))
        theirs = list(reference.configure_train(server_round, arrays, ConfigRecord(), grid))
        assert [m.metadata.dst_node_id for m in ours] == [m.metadata.dst_node_id for m in theirs]
        by_payload: dict[bytes, list[bytes]] = {}
        for a, b in zip(ours, theirs, strict=True):
            record_a = a.content.config_records[CONFIG_RECORD]
            record_b = b.content.config_records[CONFIG_RECORD]
            assert record_a.deflate() == record_b.deflate()  # every key, byte for byte
            task = TrainInstruction.from_record(record_a)
            node = a.metadata.dst_node_id
            behind = server_round - 1 - held[node] if node in held else None
            gaps.add("fresh" if behind is None else f"{min(behind, 2)} behind")
            if node in errored and node not in held:
                assert task.base_version == -1
                gaps.add("dense after error")
            by_payload.setdefault(task.model, []).append(record_a["model"])
        for same in by_payload.values():  # one bytes object per distinct payload
            assert all(p is same[0] for p in same)
        assert cached.last_round and reference.last_round
        assert cached.last_round.downlink_message_bytes == (
            reference.last_round.downlink_message_bytes
        )
        replies = list(grid.send_and_receive(ours))
        errored |= {int(r.metadata.src_node_id) for r in replies if r.has_error()}
        new, metrics = cached.aggregate_train(server_round, replies)
        new_ref, metrics_ref = reference.aggregate_train(server_round, replies)
        assert new is not None and new_ref is not None
        assert torch.equal(flat_tensor(new), flat_tensor(new_ref))
        assert metrics == metrics_ref
        arrays = new
    assert {"fresh", "1 behind", "2 behind", "dense after error"} <= gaps, gaps


def test_a_round_encodes_each_base_once_and_samples_the_mask_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many nodes, three bases: 1 dense encoding, 1 seeded mask, 1 union, whatever N is."""
    d, version = 500, 3
    cache = DownlinkCache()
    gen = torch.Generator().manual_seed(1)
    for v in (2, 3):
        cache.record_version(v, torch.rand(d, generator=gen) < 0.3, seeded=None)
    cache.record_version(3, masks.sample_mask(d, keep=200, seed=9), seeded=(9, 200))
    nodes = list(range(300))
    for node in nodes:  # a third fresh, a third one behind, a third two behind
        if node % 3:
            cache.node_applied(node, version - node % 3)
    calls = {"encode": 0, "mask": 0}

    def counting(name, fn):  # type: ignore[no-untyped-def]
        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(downlink, "encode_update", counting("encode", downlink.encode_update))
    masks._shared.cache_clear()  # the process's shared masks: sampled here, once
    monkeypatch.setattr(masks, "sample_mask", counting("mask", masks.sample_mask))
    weights = torch.randn(d, generator=gen)
    payloads = cache.payloads(nodes, weights, version=version, server_round=4)
    assert calls == {"encode": 3, "mask": 1}
    assert {base for _, base in payloads.values()} == {-1, 1, 2}
    for node in nodes:
        assert payloads[node] == cache.payload(node, weights, version=version, server_round=4)
