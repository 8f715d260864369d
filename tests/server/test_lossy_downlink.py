"""A lossy ``downlink-dtype``: the server adopts the decoded change, so every copy is its model.

``DownlinkCache.lossy_round`` encodes the round's change on its public support at the dtype's
exact size, and the model it returns is the previous one plus the decoded change; a node that
applies the payload with the client's own ``apply_downlink`` holds that model bit for bit,
whatever version it held (fresh, one behind: the change; further behind: exact values).
"""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import ConfigRecord

from fedsparse.client.state import apply_downlink
from fedsparse.common import masks
from fedsparse.common.config import FederatedConfig
from fedsparse.common.wire.payload import decode_update, encode_update, payload_size
from fedsparse.common.wire.protocol import (
    CONFIG_RECORD,
    DOWNLINK_KIND,
    ProtocolError,
    TrainInstruction,
)
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.downlink import DownlinkCache
from fedsparse.server.strategy import SparseFedAvg, flat_array, flat_tensor

D = 3000
NODES = 12


def _round(keep: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(before, after, mask): ``after`` differs from ``before`` on the seeded mask only."""
    gen = torch.Generator().manual_seed(0)
    before = torch.randn(D, generator=gen)
    mask = masks.seeded_mask(D, keep, seed)
    after = before.clone()
    after[mask] += torch.randn(keep, generator=gen) * 0.01
    return before, after, mask


def test_an_int4_change_has_the_codec_size_and_the_decoded_model() -> None:
    keep, seed, version = 1200, 5, 3
    before, after, mask = _round(keep, seed)
    cache = DownlinkCache(dtype="int4", seed=9)
    lossy = cache.lossy_round(version, before, after, mask=(seed, keep))
    assert lossy is not None
    model, touched = lossy
    payload = cache.deltas[version]
    expected = payload_size(
        keep=keep,
        dense_size=D,
        round=version + 1,
        encoding="seeded",
        mask_seed=seed,
        value_dtype="int4",
    )
    assert len(payload) == expected
    # 4 bits a value and a float32 step per 256 values, plus a header of a few dozen bytes
    packed = keep // 2 + 4 * math.ceil(keep / 256)
    assert packed < len(payload) < packed + 40
    fp32 = payload_size(
        keep=keep,
        dense_size=D,
        round=version + 1,
        encoding="seeded",
        mask_seed=seed,
        value_dtype="fp32",
    )
    assert len(payload) < fp32 / 7
    # The model moved by the decoded change on the mask, nowhere else.
    decoded = decode_update(payload, expected_dense_size=D, expected_round=version + 1)
    assert torch.equal(touched, mask)
    assert torch.equal(model[~mask], before[~mask])
    assert torch.equal(model[mask], before[mask] + decoded.values)
    assert not torch.equal(model, after)  # rounded
    step = float((after - before).abs().max()) / 7  # int4's levels: -7..7 steps of max / 7
    assert float((model - after).abs().max()) <= step * 1.0001
    # The rounding is seeded by the run seed and the round: repeated exactly, and not shared.
    again = DownlinkCache(dtype="int4", seed=9)
    again.lossy_round(version, before, after, mask=(seed, keep))
    assert again.deltas[version] == payload
    other = DownlinkCache(dtype="int4", seed=10)
    other.lossy_round(version, before, after, mask=(seed, keep))
    assert other.deltas[version] != payload
    # A node holding ``before`` adds the change as the server did.
    assert cache.kind(version - 1, version) == "delta"
    node = apply_downlink(
        before,
        version - 1,
        payload,
        base_version=version - 1,
        numel=D,
        server_round=version + 1,
        kind="delta",
    )
    assert torch.equal(node, model)


def test_fp32_sends_values_and_an_overflow_falls_back_to_them() -> None:
    before, after, _ = _round(100)
    cache = DownlinkCache()
    assert cache.lossy_round(1, before, after, mask=(5, 100)) is None
    assert cache.deltas == {} and cache.kind(0, 1) == "values"
    huge = after.clone()
    huge[0] = 1e6  # past fp16's 65504
    fp16 = DownlinkCache(dtype="fp16")
    assert fp16.lossy_round(1, before, huge, mask=None) is None
    assert fp16.deltas == {} and fp16.kind(0, 1) == "values"


def test_a_rounding_that_would_overflow_the_model_sends_exact_values() -> None:
    # int1 sends a block's zero change as +-its largest (1e37): added to a coordinate near
    # the float32 limit that rounds to inf in about half the draws, though the exact model
    # is finite; such a round goes as exact values, the others as the decoded change
    before = torch.zeros(8)
    before[1] = 3.39e38
    after = before.clone()
    after[0] = 1e37
    cache = DownlinkCache(dtype="int1", value_block=8, seed=0)
    outcomes = [cache.lossy_round(v, before, after, mask=None) for v in range(1, 41)]
    exact = [v for v, out in enumerate(outcomes, 1) if out is None]
    assert 5 <= len(exact) <= 35  # both kinds occur (binomial(40, ~1/2))
    for version, out in enumerate(outcomes, 1):
        if out is None:
            assert cache.kind(version - 1, version) == "values"
        else:
            assert bool(torch.isfinite(out[0]).all()) and out[0][1] != before[1]


def test_a_delta_that_overflows_the_nodes_copy_is_refused() -> None:
    stored = torch.zeros(8)
    stored[0] = 3.0e38
    change = torch.zeros(8)
    change[0] = 3.0e38  # finite, and so is the copy: their sum is not
    payload = encode_update(change, dense_size=8, round=5, encoding="dense", value_dtype="fp32")
    with pytest.raises(ValueError, match="downlink-kind=delta: patching model version 3 gives 1 "):
        apply_downlink(stored, 3, payload, base_version=3, numel=8, server_round=5, kind="delta")


@pytest.mark.parametrize("kind", ["bogus", "", 1, None])
def test_the_client_refuses_an_unknown_payload_kind(kind: object) -> None:
    before, after, _ = _round(100)
    cache = DownlinkCache(dtype="int8")
    cache.lossy_round(1, before, after, mask=None)
    with pytest.raises(ProtocolError, match=f"downlink-kind={kind!r}: expected one of values, d"):
        apply_downlink(
            before, 0, cache.deltas[1], base_version=0, numel=D, server_round=2, kind=kind
        )


def test_a_change_for_a_version_the_node_does_not_hold_is_refused() -> None:
    before, after, _ = _round(100)
    cache = DownlinkCache(dtype="int2")
    cache.lossy_round(2, before, after, mask=(5, 100))
    with pytest.raises(ValueError, match="base-version=1: this node holds model version 0"):
        apply_downlink(
            before, 0, cache.deltas[2], base_version=1, numel=D, server_round=3, kind="delta"
        )
    with pytest.raises(ValueError, match="holds model version -1"):
        apply_downlink(
            None, -1, cache.deltas[2], base_version=1, numel=D, server_round=3, kind="delta"
        )


@pytest.mark.parametrize(
    ("dtype", "block"), [("int4", 256), ("int1", 64), ("fp16", 256), ("fp32", 256)]
)
def test_every_node_holds_the_servers_model_bit_for_bit(
    make_synthetic_client, dtype: str, block: int
) -> None:
    """8 rounds, 12 nodes, 5 a round, dense round 1 (gradual): each selected node patches its
    copy with the real ``apply_downlink`` and holds exactly the server's model, whether it is
    fresh, one version behind (the change) or further behind (exact values); fp32 sends
    values to all, in the messages of before (no ``downlink-kind``)."""
    cfg = FederatedConfig(
        num_rounds=8,
        final_rate=0.6,
        clients_per_round=5,
        downlink_dtype=dtype,  # type: ignore[arg-type]
        value_block=block,
        seed=11,
    )
    client = make_synthetic_client(cfg, D)
    grid = InProcessGrid(client, num_nodes=NODES, run_config=cfg.to_run_config())
    strategy = SparseFedAvg(cfg, num_parameters=D)
    arrays = flat_array(torch.randn(D, generator=torch.Generator().manual_seed(0)))
    copies: dict[int, tuple[torch.Tensor, int]] = {}
    seen: set[str] = set()
    for server_round in range(1, cfg.num_rounds + 1):
        server = flat_tensor(arrays)
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
        down = 0
        for message in messages:
            record = message.content.config_records[CONFIG_RECORD]
            task = TrainInstruction.from_record(record)
            node = message.metadata.dst_node_id
            kind = record.get(DOWNLINK_KIND, "values")
            stored, version = copies.get(node, (None, -1))
            behind = "fresh" if stored is None else f"{min(server_round - 1 - version, 2)} behind"
            seen.add(f"{kind}, {behind}")
            lossy = dtype != "fp32" and behind == "1 behind" and server_round > 1
            assert (kind == "delta") == lossy
            assert (DOWNLINK_KIND in record) == lossy  # fp32: the messages of before
            flat = apply_downlink(
                stored,
                version,
                task.model,
                base_version=task.base_version,
                numel=D,
                server_round=server_round,
                kind=kind,
            )
            assert torch.equal(flat, server), (server_round, node, kind, behind)
            copies[node] = (flat, task.model_version)
            down += len(task.model)
        replies = list(grid.send_and_receive(messages))
        assert strategy.last_round is not None
        assert strategy.last_round.downlink_payload_bytes == down
        arrays, _ = strategy.aggregate_train(server_round, replies)
        assert arrays is not None
    one_behind = "values" if dtype == "fp32" else "delta"
    assert {"values, fresh", f"{one_behind}, 1 behind", "values, 2 behind"} <= seen, seen
