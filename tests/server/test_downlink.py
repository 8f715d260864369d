"""The downlink cache: what each node is sent, and that applying it is exact."""

import torch

from fedsparse.client.state import apply_downlink
from fedsparse.common.masks import keep_count, sample_mask
from fedsparse.common.wire.payload import decode_update, payload_size
from fedsparse.server.downlink import DownlinkCache

D = 5_000
NODE = 1001


def _step(cache: DownlinkCache, weights: torch.Tensor, version: int, seed: int, rate: float):
    """One round: the coordinates of the seeded mask change; recorded as ``version``."""
    mask = sample_mask(D, keep=keep_count(D, rate=rate), seed=seed)
    weights[mask] += torch.randn(int(mask.sum()), generator=torch.Generator().manual_seed(seed))
    cache.record_version(version, mask, seeded=(seed, keep_count(D, rate=rate)))
    return mask


def _apply(cache, node, held, held_version, weights, version, server_round):
    payload, base = cache.payload(node, weights, version=version, server_round=server_round)
    flat = apply_downlink(
        held, held_version, payload, base_version=base, numel=D, server_round=server_round
    )
    return payload, base, flat


def test_first_contact_is_dense_and_exact() -> None:
    cache = DownlinkCache()
    weights = torch.randn(D)
    payload, base, flat = _apply(cache, NODE, None, -1, weights, 0, 1)
    assert base == -1 and decode_update(payload).encoding == "dense"
    assert torch.equal(flat, weights)


def test_one_version_behind_gets_values_on_the_seeded_mask_only() -> None:
    cache = DownlinkCache()
    weights = torch.randn(D)
    held = weights.clone()
    cache.node_applied(NODE, 0)
    _step(cache, weights, 1, seed=11, rate=0.9)
    payload, base, flat = _apply(cache, NODE, held, 0, weights, 1, 2)
    keep = keep_count(D, rate=0.9)
    assert base == 0 and decode_update(payload).encoding == "seeded"
    size = payload_size(
        keep=keep, dense_size=D, round=2, encoding="seeded", value_dtype="fp32", mask_seed=11
    )
    assert len(payload) == size and size - 4 * keep <= 64  # values only
    assert torch.equal(flat, weights)


def test_two_versions_behind_gets_the_union_with_an_explicit_support() -> None:
    cache = DownlinkCache()
    weights = torch.randn(D)
    held = weights.clone()
    cache.node_applied(NODE, 0)
    m1 = _step(cache, weights, 1, seed=11, rate=0.95)
    m2 = _step(cache, weights, 2, seed=12, rate=0.95)
    payload, base, flat = _apply(cache, NODE, held, 0, weights, 2, 3)
    update = decode_update(payload)
    assert base == 0 and update.encoding in ("coo", "delta", "bitmap")
    assert torch.equal(update.support(), torch.nonzero(m1 | m2).flatten())
    assert torch.equal(flat, weights)


def test_a_large_union_falls_back_to_dense() -> None:
    cache = DownlinkCache()
    weights = torch.randn(D)
    held = weights.clone()
    cache.node_applied(NODE, 0)
    for v in range(1, 6):
        _step(cache, weights, v, seed=20 + v, rate=0.3)
    payload, base, flat = _apply(cache, NODE, held, 0, weights, 5, 6)
    assert base == -1 and decode_update(payload).encoding == "dense"
    assert torch.equal(flat, weights)


def test_forgotten_nodes_and_unknown_history_get_the_dense_model() -> None:
    cache = DownlinkCache()
    weights = torch.randn(D)
    cache.node_applied(NODE, 0)
    cache.forget(NODE)
    assert cache.payload(NODE, weights, version=1, server_round=2)[1] == -1
    cache.node_applied(NODE, 0)  # version 1 was never recorded: cannot patch
    assert cache.payload(NODE, weights, version=1, server_round=2)[1] == -1


def test_unseeded_change_is_sent_with_its_support() -> None:
    """Per-client masks (no shared seed) change a data-dependent union: explicit support."""
    cache = DownlinkCache(codec="values")
    weights = torch.randn(D)
    held = weights.clone()
    cache.node_applied(NODE, 0)
    touched = torch.zeros(D, dtype=torch.bool)
    touched[::50] = True
    weights[touched] += 1.0
    cache.record_version(1, touched, seeded=None)
    payload, base, flat = _apply(cache, NODE, held, 0, weights, 1, 2)
    assert base == 0 and decode_update(payload).encoding != "seeded"
    assert torch.equal(flat, weights)
