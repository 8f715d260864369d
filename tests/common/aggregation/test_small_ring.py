"""The small ring's math (``small_ring.py`` and the modular ``RingParams``): the rotation is
orthogonal and flattens, conditional rounding never exceeds its bound and meets it as often
as Kairouz et al.'s lemma says, the closed-form scale solves its equation, the calibrated
ring carries its central target, the wraps of aligned inputs stay under their bound, the
decoded sum is the true sum to its rounding and noise, and the bit packing is exact."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from scipy.linalg import hadamard

from fedsparse.common import config_values
from fedsparse.common.aggregation import small_ring
from fedsparse.common.aggregation.secure import (
    DECODE_BITS,
    RingParams,
    central_noise_multiplier,
    check_ring,
    choose_ring,
    decode_sum,
    discrete_gaussian,
    encode,
    pack_input,
    quantize,
    ring_for_central,
    ring_sum,
    unpack_input,
    worst_case_noise_multiplier,
    wrap_probability_bound,
)
from fedsparse.common.aggregation.small_ring import (
    BETA,
    conditional_round,
    expected_wraps,
    flatten,
    pack_bits,
    rotation_seed,
    rounding_bound,
    small_scale,
    unflatten,
    unpack_bits,
    window,
)

SEED = rotation_seed(7, b"fedsparse-small-ring")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def small(**over: object) -> RingParams:
    args: dict[str, object] = dict(
        clip=1.0, sigma=1.0, clients=100, threshold=60, kept=1000, bits=12
    )
    args.update(over)
    return choose_ring(**args)  # type: ignore[arg-type]


def test_the_hadamard_transform_is_scipys_normalised() -> None:
    x = torch.randn(64, generator=gen(0), dtype=torch.float64)
    expected = torch.from_numpy(hadamard(64).astype(np.float64)) @ x / 8
    assert torch.allclose(small_ring._hadamard(x), expected, atol=1e-12)


@pytest.mark.parametrize("kept", [1, 2, 3, 7, 64, 100, 129])
def test_the_rotation_is_orthogonal_and_unflatten_is_its_inverse(kept: int) -> None:
    eye = torch.eye(kept, dtype=torch.float64)
    matrix = torch.stack([flatten(column, SEED) for column in eye], dim=1)
    assert torch.allclose(matrix.T @ matrix, eye, atol=1e-12)
    back = torch.stack([unflatten(column, SEED) for column in matrix.T], dim=0)
    assert torch.allclose(back, eye, atol=1e-12)
    if kept > 7:  # the signs are the seed's: another round rotates otherwise
        other = torch.stack([flatten(c, rotation_seed(8, b"x" * 16)) for c in eye], dim=1)
        assert not torch.allclose(matrix, other)


def test_the_rotation_seed_binds_the_round_and_the_nonce() -> None:
    seeds = {rotation_seed(r, n) for r in (1, 2) for n in (b"a" * 16, b"b" * 16, b"a" * 17)}
    assert len(seeds) == 6 and all(len(s) == 32 for s in seeds)


@pytest.mark.parametrize("kept", [1000, 1024])
def test_a_rotated_spike_is_sub_gaussian_with_proxy_norm_over_the_window(kept: int) -> None:
    """One coordinate holding the whole norm (the exact ring's worst case): over 400 rotations
    every output coordinate's tail is below the sub-Gaussian ``2 exp(-z^2/2)`` for proxy
    ``1/d'`` (4 standard errors of the empirical rate above it allowed)."""
    spike = torch.zeros(kept, dtype=torch.float64)
    spike[3] = 1.0
    rotated = torch.stack([flatten(spike, rotation_seed(r, b"s" * 16)) for r in range(400)])
    scaled = rotated.abs() * math.sqrt(window(kept))
    assert torch.allclose(rotated.norm(dim=1), torch.ones(400, dtype=torch.float64))
    for z in (2.0, 3.0, 4.0):
        bound = 2 * math.exp(-z * z / 2)
        rate = float((scaled > z).double().mean())
        se = math.sqrt(bound * (1 - bound) / 400)  # per coordinate; a conservative standard error
        assert rate <= bound + 4 * se
    assert float(rotated.abs().max()) < 6 / math.sqrt(window(kept))


def test_the_window_is_the_largest_power_of_two_in_k() -> None:
    assert [window(k) for k in (1, 2, 3, 1000, 1024, 3800)] == [1, 2, 2, 512, 1024, 2048]
    with pytest.raises(ValueError, match="kept must be >= 1"):
        window(0)


def test_conditional_rounding_never_exceeds_its_bound_and_is_met_as_the_lemma_says() -> None:
    """The worst case for the rounding's norm: every fractional part 1/2, norm exactly sC.
    The bound holds on every returned vector; an unconditioned draw meets it with
    probability at least ``1 - beta`` (measured over 2,000 draws, 4 standard errors)."""
    kept, scaled_clip = 400, 30.0
    v = torch.full((kept,), 0.5, dtype=torch.float64)
    v[0] = math.sqrt(scaled_clip**2 - (kept - 1) * 0.25)  # ||v|| = sC, v_0's fraction set
    v[0] = math.floor(v[0]) + 0.5
    v = v * (scaled_clip / float(v.norm()))
    bound = rounding_bound(scaled_clip, kept)
    assert bound == pytest.approx(math.sqrt(900 + 100 + 1.0 * (30 + 10)))
    g = gen(1)
    limit = math.floor(bound * bound)
    for _ in range(200):
        q = conditional_round(v, bound, g)
        assert int((q * q).sum()) <= limit
        assert torch.all((q - v).abs() < 1)
    draws = 2000
    low = torch.floor(v)
    hits = 0
    for _ in range(draws):
        q = low + (torch.rand(kept, generator=g, dtype=torch.float64) < v - low)
        hits += int(float((q * q).sum()) <= limit)
    se = math.sqrt(BETA * (1 - BETA) / draws)
    assert hits / draws >= 1 - BETA - 4 * se


def test_conditional_rounding_is_a_clear_error_when_no_draw_can_meet_the_bound() -> None:
    v = torch.full((10,), 3.5, dtype=torch.float64)  # every rounding has norm >= sqrt(90)
    with pytest.raises(ValueError, match="no rounding within the norm bound 5"):
        conditional_round(v, 5.0, gen(0))


@pytest.mark.parametrize(("bits", "clients", "kept"), [(12, 1000, 3800), (10, 100, 500)])
def test_the_small_scale_solves_its_equation(bits: int, clients: int, kept: int) -> None:
    sigma, threshold = 1.3, clients // 2 + 1
    s = small_scale(
        bits=bits, clip=2.0, sigma=sigma, clients=clients, threshold=threshold, kept=kept
    )
    g = 1 / s
    variance = clients**2 * 4.0 / window(kept) + clients * g * g / 4
    variance += clients * (sigma * 2.0) ** 2 / threshold
    assert 2**bits * g == pytest.approx(2 * small_ring.SIGNAL_STDDEVS * math.sqrt(variance))


def test_a_ring_too_small_for_its_clients_rounding_is_refused() -> None:
    # 2^(b-1) = 128 against z sqrt(n) / 2 = 2 sqrt(5000) = 141
    with pytest.raises(ValueError, match="8-bit ring cannot hold the rounding of 5000"):
        small_scale(bits=8, clip=1.0, sigma=1.0, clients=5000, threshold=2501, kept=100)


def test_a_small_ring_accounts_its_rounding_bound_as_the_sensitivity() -> None:
    p = small()
    assert p.modular and p.bits == 12
    assert p.sensitivity == rounding_bound(p.scale * p.clip, p.kept)
    assert p.sensitivity < p.scale * p.clip + math.sqrt(p.kept)  # tighter than the worst case
    assert p.input_bytes == math.ceil(1000 * 12 / 8)
    central = central_noise_multiplier(p, 60)
    assert central == pytest.approx(p.share_std * math.sqrt(60) / p.sensitivity)
    assert worst_case_noise_multiplier(p) == pytest.approx(p.share_std / p.sensitivity)
    exact = choose_ring(clip=1.0, sigma=1.0, clients=100, threshold=60, kept=1000)
    assert not exact.modular and exact.input_bytes == 1000 * ((exact.bits + 7) // 8)


@pytest.mark.parametrize("seed", range(3))
def test_every_quantized_input_lies_within_the_sensitivity(seed: int) -> None:
    """Whatever the values (over the clip, on one coordinate, at fractional parts of 1/2):
    the integer vector a client adds has norm at most ``Delta``, the accounted sensitivity."""
    p = small(kept=256, clients=20, threshold=11)
    g = gen(seed)
    spike = torch.zeros(256, dtype=torch.float64)
    spike[seed] = 5.0
    cases = [spike, torch.randn(256, generator=g, dtype=torch.float64) * 3]
    cases.append(torch.full((256,), 0.5 / p.scale, dtype=torch.float64))
    for values in cases:
        for r in range(20):
            q = quantize(values, p, g, rotation_seed(r, b"q" * 16))
            assert float(q.double().norm()) <= p.sensitivity
    with pytest.raises(ValueError, match="rotation seed"):
        quantize(spike, p, g)
    zero = quantize(torch.zeros(256, dtype=torch.float64), p, g, SEED)
    assert torch.equal(zero, torch.zeros(256, dtype=torch.int64))  # a zeroed client adds 0


def test_conditional_rounding_checks_the_norm_exactly_past_int64() -> None:
    """At 40 bits a client's squared norm is over 2^63: the check sums Python ints, so every
    rounded vector is within the bound (an int64 sum wraps negative and passes anything)."""
    p = small(bits=40, clients=100, threshold=51, kept=3829)
    assert p.sensitivity**2 > 2**63
    g = gen(3)
    values = torch.randn(3829, generator=g, dtype=torch.float64)
    for r in range(30):
        q = quantize(values, p, g, rotation_seed(r, b"b" * 16))
        assert sum(x * x for x in q.tolist()) <= math.floor(p.sensitivity**2)


@pytest.mark.parametrize("target", [0.7, 1.0, 2.5])
def test_the_calibrated_small_ring_carries_its_central_target(target: float) -> None:
    p = ring_for_central(target, clip=1.0, clients=100, threshold=60, kept=1000, bits=12)
    carried = central_noise_multiplier(p, 60)
    assert target <= carried <= target * (1 + 1e-9)
    assert p.modular and p.bits == 12
    assert central_noise_multiplier(p, 100) > carried  # more survivors carry more


def test_a_ring_that_cannot_carry_the_target_says_so() -> None:
    """At 11 bits and 1,000 clients the scale falls as sigma grows until the rounding is all
    of the sensitivity: the carried multiplier saturates (near 5.8) below a large target. At
    10 bits and sigma = 1 the shares (0.26 ring units) are too small for the accounting, as
    in the exact ring; at 8 bits 5,000 clients' rounding alone overflows the ring, whatever
    sigma, and that is what the calibration says."""
    with pytest.raises(ValueError, match="carries no central noise multiplier 50"):
        ring_for_central(50.0, clip=1.0, clients=1000, threshold=501, kept=3800, bits=11)
    with pytest.raises(ValueError, match=r"too small for the accounting.*widen the ring"):
        choose_ring(clip=1.0, sigma=1.0, clients=1000, threshold=501, kept=3800, bits=10)
    with pytest.raises(ValueError, match="8-bit ring cannot hold the rounding of 5000"):
        ring_for_central(1.0, clip=1.0, clients=5000, threshold=2501, kept=100, bits=8)


def test_a_node_recomputes_a_small_ring_and_refuses_another_scale_or_width() -> None:
    p = small()
    check_ring(p, min_noise_multiplier=0.01)
    with pytest.raises(ValueError, match="scale is"):
        check_ring(dataclasses.replace(p, scale=p.scale * 2), min_noise_multiplier=0.01)
    with pytest.raises(ValueError, match="scale is"):  # 13 bits give another scale
        check_ring(dataclasses.replace(p, bits=13), min_noise_multiplier=0.01)
    with pytest.raises(ValueError, match="scale is .*, the parameters give 3162"):
        check_ring(dataclasses.replace(p, modular=False), min_noise_multiplier=0.01)


def _inputs(p: RingParams, values: list[torch.Tensor], seed: int, rotation: bytes) -> list:
    return [
        encode(v, p, gen(seed + i), gen(10_000 + seed + i), rotation) for i, v in enumerate(values)
    ]


def test_the_decoded_sum_is_the_true_sum_to_its_rounding_and_noise() -> None:
    """20 clients, independent directions: every coordinate of the decoded, rotated-back sum
    within 6 standard deviations of rounding (1/4 a client) and noise of the truth, and the
    ring sum the exact sum of the integer inputs mod 2^b."""
    p = small(kept=300, clients=20, threshold=11)
    g = gen(5)
    values = [
        v / float(v.norm()) * 0.8 for v in torch.randn(20, 300, generator=g, dtype=torch.float64)
    ]
    inputs = _inputs(p, values, 0, SEED)
    total = ring_sum(inputs, p.bits)
    assert torch.equal(total, torch.stack(inputs).sum(dim=0) % p.modulus)
    decoded = decode_sum(total, p, SEED)
    truth = torch.stack(values).sum(dim=0)
    std = math.sqrt(20 / 4 + 20 * p.share_std**2) / p.scale
    assert float((decoded - truth).abs().max()) < 6 * std
    with pytest.raises(ValueError, match="rotation seed"):
        decode_sum(total, p)


def test_aligned_inputs_wrap_no_more_than_their_bound_and_privacy_needs_no_wrap_bound() -> None:
    """50 clients all sending one vector (the worst case the scale is made for) in a 9-bit ring
    of 256 values: the wrapped coordinates, counted against the unreduced sum over 40 rounds,
    average below ``expected_wraps``; a wrapped coordinate comes back off by ``2^b / s``."""
    p = small(kept=256, clients=50, threshold=26, bits=9, sigma=0.5)
    bound = expected_wraps(
        bits=9, scale=p.scale, clip=1.0, share_std=p.share_std, clients=50, kept=256
    )
    assert wrap_probability_bound(p) == min(1.0, bound)
    g = gen(9)
    wrapped = []
    for r in range(40):
        rotation = rotation_seed(r, b"w" * 16)
        v = torch.randn(256, generator=g, dtype=torch.float64)
        exact = sum(  # the inputs before their reduction mod 2^b
            quantize(v / float(v.norm()), p, gen(100 * r + i), rotation)
            + discrete_gaussian(256, p.share_std, gen(10_000 + 100 * r + i))
            for i in range(50)
        )
        half = p.modulus >> 1
        wrapped.append(int(((exact < -half) | (exact >= half)).sum()))
    mean = float(np.mean(wrapped))
    assert mean <= bound + 4 * float(np.std(wrapped)) / math.sqrt(40) + 1e-12
    assert bound > 0  # the bound is not vacuous at this width: a real check


@pytest.mark.parametrize("bits", [8, 9, 12, 17, 31, 54])
def test_bit_packing_round_trips_and_refuses_bad_lengths_and_spare_bits(bits: int) -> None:
    kept = 37
    values = torch.randint(0, 1 << min(bits, 62), (kept,), generator=gen(bits))
    values[0] = (1 << bits) - 1
    data = pack_bits(values, bits)
    assert len(data) == math.ceil(kept * bits / 8)
    assert torch.equal(unpack_bits(data, kept, bits), values)
    with pytest.raises(ValueError, match=f"expected {len(data)} bytes"):
        unpack_bits(data + b"\x00", kept, bits)
    if kept * bits % 8:
        spoiled = data[:-1] + bytes([data[-1] | 0x80])
        with pytest.raises(ValueError, match="spare bits"):
            unpack_bits(spoiled, kept, bits)


def test_a_small_rings_masked_input_is_bit_packed() -> None:
    p = small(kept=101, bits=12)
    values = torch.randint(0, 1 << 12, (101,), generator=gen(0))
    data = pack_input(values, p)
    assert len(data) == p.input_bytes == 152
    assert torch.equal(unpack_input(data, p), values)


def test_the_config_checks_widest_small_ring_is_the_decoders() -> None:
    assert config_values.SMALL_RING_BITS == DECODE_BITS
