"""Secure aggregation in a small ring (``secagg-ring-bits``), server and clients as plain
state machines: the masks cancel in 12 bits, the decoded sum is the ring sum rotated back, a
masked input is bit-packed, the setup says ``modular`` and a node refuses what its ring is
not, and a digest tells a small ring from the exact one of the same numbers."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fedsparse.client.secagg import SecAggClient
from fedsparse.common.aggregation.secure import (
    RingParams,
    choose_ring,
    decode_sum,
    unpack_input,
)
from fedsparse.common.aggregation.small_ring import rotation_seed, unflatten
from fedsparse.common.wire.secagg import SETUP, SecAggError, check_payload, ring_digest
from tests.server.test_secagg import IDS, RING_INPUTS, K, Round, record_ring_inputs  # noqa: F401


def small(bits: int = 12, sigma: float = 1.0) -> RingParams:
    return choose_ring(clip=1.0, sigma=sigma, clients=5, threshold=3, kept=K, bits=bits)


@pytest.mark.parametrize("drop", [(), (303,)])
def test_the_masks_cancel_in_a_small_ring_and_the_sum_is_rotated_back(
    drop: tuple[int, ...],
) -> None:
    r = Round(small(), min_noise_multiplier=0.2)
    setup = r.server.setup_messages()
    assert {m["modular"] for m in setup.values()} == {1} and setup[IDS[0]]["bits"] == 12
    r.keys()
    r.collect(drop=drop)
    for reply in r.masked.values():  # bit-packed: 12 bits a value, not 2 bytes
        assert len(reply["masked_params"]) == math.ceil(K * 12 / 8) == r.p.input_bytes
    total = r.unmask()
    survivors = [n for n in IDS if n not in drop]
    assert torch.equal(total, r.expected(survivors))
    rotation = rotation_seed(r.server.round_id, r.server.nonce)
    decoded = r.server.decode(total)
    half = r.p.modulus >> 1
    lifted = torch.where(total >= half, total - r.p.modulus, total).double() / r.p.scale
    assert torch.equal(decoded, unflatten(lifted, rotation))
    truth = sum(r.inputs[n] for n in survivors)
    assert isinstance(truth, torch.Tensor)
    spread = math.sqrt(len(survivors) * (0.25 + r.p.share_std**2)) / r.p.scale
    assert float((decoded - truth).abs().max()) < 6 * spread
    assert not torch.equal(decoded, decode_sum(total, dataclasses.replace(r.p, modular=False)))


def test_a_small_rings_masked_input_of_the_wrong_length_is_named() -> None:
    r = Round(small())
    r.keys()
    replies = r.replies()
    victim = IDS[1]
    replies[victim] = dict(replies[victim], masked_params=b"\x00" * (K * 2))  # 2 bytes each
    with pytest.raises(SecAggError, match=f"field 'masked_params' of node {victim}: expected"):
        r.server.receive_collect(replies)
    odd = dataclasses.replace(r.p, kept=K - 1)  # 999 x 12 bits: the last byte's top half spare
    with pytest.raises(ValueError, match="spare bits"):
        unpack_input(b"\x00" * (odd.input_bytes - 1) + b"\xf0", odd)


def test_the_setup_field_modular_is_one_or_absent() -> None:
    r = Round(small())
    message = r.server.setup_messages()[IDS[0]]
    assert check_payload(message, SETUP, "down")["modular"] == 1
    with pytest.raises(SecAggError, match="field 'modular' holds 2, not a small ring's"):
        check_payload({**message, "modular": 2}, SETUP, "down")
    plain = {k: v for k, v in message.items() if k != "modular"}
    assert "modular" not in check_payload(plain, SETUP, "down")


def test_a_client_refuses_a_small_ring_whose_scale_is_not_its_width() -> None:
    p = small()
    with pytest.raises(SecAggError, match="ring parameters refused: scale is"):
        SecAggClient(IDS[0], dataclasses.replace(p, bits=13), min_noise_multiplier=0.1)
    with pytest.raises(SecAggError, match="ring parameters refused: scale is"):
        SecAggClient(IDS[0], dataclasses.replace(p, modular=False), min_noise_multiplier=0.1)


def test_the_ring_digest_binds_the_modular_flag() -> None:
    p = small()
    ring = {name: getattr(p, name) for name in ("clip", "sigma", "clients", "threshold")}
    ring |= {"kept": p.kept, "scale": p.scale, "bits": p.bits, "colluders": 0}
    keys = ([1, 2], [b"a", b"b"], [b"c", b"d"], [b"", b""])
    assert ring_digest(ring, *keys) != ring_digest({**ring, "modular": 1}, *keys)
    assert ring_digest(ring, *keys) == ring_digest({**ring, "modular": 0}, *keys)


def test_the_ring_width_must_be_the_run_configs_both_ways() -> None:
    """A node made for a small ring refuses the exact ring's setup, and the other way round."""
    modular, exact = small(), choose_ring(clip=1.0, sigma=1.0, clients=5, threshold=3, kept=K)
    plain = Round(exact).server.setup_messages()[IDS[0]]
    with pytest.raises(SecAggError, match="field 'scale' is 3162.*, this node's run config says"):
        SecAggClient(IDS[0], modular, min_noise_multiplier=0.1).handle(plain)
    forged = {**plain, "scale": modular.scale, "bits": 12}  # the numbers, not the flag
    with pytest.raises(SecAggError, match="field 'modular' is 0, this node's run config says"):
        SecAggClient(IDS[0], modular, min_noise_multiplier=0.1).handle(forged)
    small_setup = Round(modular).server.setup_messages()[IDS[0]]
    with pytest.raises(SecAggError, match="this node's run config says"):
        SecAggClient(IDS[0], exact, min_noise_multiplier=0.1).handle(small_setup)
    assert set(SecAggClient(IDS[0], modular, min_noise_multiplier=0.1).handle(small_setup)) == {
        "pk1",
        "pk2",
        "seeded_noise",
    }


def test_a_small_ring_is_saved_and_a_forged_kind_is_refused() -> None:
    """A node's saved state keeps the ring's kind (a bool): restored, it is the same small
    ring; a kind saved as 1 or "True", or False beside a small ring's scale, is refused."""
    client = SecAggClient(IDS[0], small(), min_noise_multiplier=0.1)
    state = client.to_state()
    assert state["ring.modular"] is True
    assert SecAggClient.from_state(state).params == small()
    for forged in (1, "True", None, False):
        with pytest.raises(SecAggError, match="saved state is unusable|ring parameters refused"):
            SecAggClient.from_state({**state, "ring.modular": forged})
    plain = choose_ring(clip=1.0, sigma=1.0, clients=5, threshold=3, kept=K)
    exact = SecAggClient(IDS[0], plain, min_noise_multiplier=0.1).to_state()
    del exact["ring.modular"]  # a state saved before small rings: the exact ring
    assert not SecAggClient.from_state(exact).params.modular
