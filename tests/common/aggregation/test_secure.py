"""Secure aggregation's math: ring choice and wrap bound, exact modular sums, unbiased rounding,
the discrete Gaussian shares and their accounting, the masks."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from scipy import stats

from fedsparse.common.aggregation.secure import (
    DECODE_BITS,
    TAU_LIMIT,
    RingParams,
    central_noise_multiplier,
    check_ring,
    check_threshold,
    choose_ring,
    decode_sum,
    discrete_gaussian,
    discrete_gaussian_variance,
    encode,
    expand_mask,
    mask_input,
    noise_share_std,
    pack_ring,
    quantize,
    remove_masks,
    ring_for_central,
    ring_sum,
    stochastic_round,
    sum_divergence_tau,
    unpack_ring,
    worst_case_noise_multiplier,
    wrap_probability_bound,
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ring(**over: object) -> RingParams:
    args: dict[str, object] = dict(clip=1.0, sigma=1.0, clients=5, threshold=3, kept=1000)
    args.update(over)
    return choose_ring(**args)  # type: ignore[arg-type]


def unit_vectors(n: int, k: int, norm: float, seed: int) -> list[torch.Tensor]:
    g = gen(seed)
    out = []
    for _ in range(n):
        v = torch.randn(k, generator=g, dtype=torch.float64)
        out.append(v * (norm / float(v.norm())))
    return out


# -- the ring ---------------------------------------------------------------------------------


def test_the_ring_is_the_smallest_whose_wrap_bound_holds() -> None:
    for k, sigma, n, t in [(1000, 1.0, 5, 3), (10**6, 0.7, 20, 15), (10, 0.0, 3, 2)]:
        p = choose_ring(clip=2.0, sigma=sigma, clients=n, threshold=t, kept=k)
        assert p.scale == pytest.approx(math.sqrt(k) / (0.01 * 2.0))
        assert wrap_probability_bound(p) <= 1e-9
        smaller = dataclasses.replace(p, bits=p.bits - 1)
        assert wrap_probability_bound(smaller) > 1e-9
    # a looser bound or a coarser rounding never needs more bits
    assert ring(wrap_probability=1e-3).bits <= ring().bits
    assert ring(rounding_slack=0.1).bits < ring().bits


def test_a_ring_built_by_hand_is_checked() -> None:
    p = ring()
    for field, value in [("threshold", 1), ("scale", 0.0), ("bits", 63), ("sigma", math.nan)]:
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(p, **{field: value})


def test_a_ring_over_the_exact_decoding_range_is_refused() -> None:
    with pytest.raises(ValueError, match=f"more than {DECODE_BITS}"):
        ring(rounding_slack=1e-16)
    # at the largest ring it picks, the lift's extremes (±2^53) decode exactly in float64
    p = RingParams(1.0, 1.0, 5, 3, 1, 1.0, DECODE_BITS)
    top = 2 ** (DECODE_BITS - 1)
    decoded = decode_sum(torch.tensor([top - 1, top, top + 1]), p)
    assert [int(v) for v in decoded.tolist()] == [top - 1, -top, -top + 1]


def test_the_wrap_bound_of_a_noiseless_ring_that_just_fits_is_zero() -> None:
    # 2 clients, one coordinate: |Q| <= 2 (sC + 1) = 7 = 2^(b-1) - 1 at b = 4: nothing wraps
    fits = RingParams(clip=1.0, sigma=0.0, clients=2, threshold=2, kept=1, scale=2.5, bits=4)
    assert wrap_probability_bound(fits) == 0.0
    assert wrap_probability_bound(dataclasses.replace(fits, bits=3)) == 1.0


def test_a_noisy_ring_too_fine_for_the_accounting_is_refused() -> None:
    # share std 0.065 ring units: the sum is nothing like one discrete Gaussian (all zeros)
    with pytest.raises(ValueError, match="too small for the accounting"):
        choose_ring(clip=1.0, sigma=0.5, clients=100, threshold=60, kept=1, rounding_slack=1.0)
    p = ring()
    assert sum_divergence_tau(p.share_std, p.clients) * p.kept <= TAU_LIMIT


def test_the_client_side_check_recomputes_the_ring_and_its_noise_floor() -> None:
    p = ring()  # n=5, t=3: worst case 0.572
    check_ring(p, min_noise_multiplier=0.5)
    with pytest.raises(ValueError, match="worst-case noise multiplier .* below .* 0.6"):
        check_ring(p, min_noise_multiplier=0.6)
    # a large nominal n shrinks each share while the central multiplier stays near sigma
    big = choose_ring(clip=1.0, sigma=1.0, clients=1000, threshold=501, kept=1000)
    assert central_noise_multiplier(big, 501) > 0.98
    with pytest.raises(ValueError, match=r"share alone\) is 0.0442\d, below"):
        check_ring(big, min_noise_multiplier=0.5)
    with pytest.raises(ValueError, match="sigma must be positive"):
        check_ring(ring(sigma=0.0), min_noise_multiplier=0.0)
    for field, value in [("scale", p.scale * 1.01), ("bits", p.bits + 1)]:
        with pytest.raises(ValueError, match=f"{field} is .* the parameters give"):
            check_ring(dataclasses.replace(p, **{field: value}), min_noise_multiplier=0.5)
    # the client's own slack or wrap probability gives its own ring
    with pytest.raises(ValueError, match="scale is"):
        check_ring(p, min_noise_multiplier=0.5, rounding_slack=0.02)
    with pytest.raises(ValueError, match="colluders is 0, this node requires at least 1"):
        check_ring(p, min_noise_multiplier=0.5, colluders=1)
    four = ring(threshold=4, colluders=1)
    check_ring(four, min_noise_multiplier=0.4, colluders=1)


def test_the_rounded_sensitivity_costs_at_most_the_slack() -> None:
    p = ring(rounding_slack=0.01)
    assert p.sensitivity == pytest.approx(p.scale * p.clip * 1.01)


@pytest.mark.parametrize(("n", "t"), [(5, 2), (4, 2), (5, 6), (1, 1), (5, 0)])
def test_a_threshold_at_or_below_half_the_clients_is_refused(n: int, t: int) -> None:
    with pytest.raises(ValueError, match="threshold|at least 2"):
        check_threshold(n, t)
    with pytest.raises(ValueError):
        choose_ring(clip=1.0, sigma=1.0, clients=n, threshold=t, kept=10)


@pytest.mark.parametrize(
    ("n", "t", "c", "ok"),
    [(5, 3, 0, True), (5, 3, 1, False), (5, 4, 1, True), (10, 6, 2, False), (10, 7, 2, True)]
    + [(100, 60, 19, True), (100, 60, 20, False), (5, 5, 5, False), (5, 3, -1, False)],
)
def test_the_threshold_keeps_2t_minus_n_above_the_colluders(
    n: int, t: int, c: int, ok: bool
) -> None:
    # each honest client answers once, a colluder gives both shares, the victim its seed share:
    # both of a victim's secrets need 2t - c - 1 answers from the n - 1 others
    assert ok == (2 * t - c - 1 > n - 1 and c >= 0)
    if ok:
        check_threshold(n, t, c)
        assert choose_ring(clip=1.0, sigma=1.0, clients=n, threshold=t, kept=10, colluders=c)
    else:
        with pytest.raises(ValueError, match="2t - n > c|colluders"):
            check_threshold(n, t, c)
        with pytest.raises(ValueError):
            RingParams(1.0, 1.0, n, t, 10, 1.0, 20, c)


@pytest.mark.parametrize(
    ("field", "value"), [("clip", 0.0), ("sigma", -1.0), ("kept", 0), ("wrap_probability", 1.0)]
)
def test_bad_ring_parameters_are_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        ring(**{field: value})


def test_the_decoded_sum_is_the_exact_integer_sum_mod_the_ring() -> None:
    p = ring(sigma=1.0)
    inputs = unit_vectors(5, p.kept, 1.0, seed=1)
    quantized = [quantize(x, p, gen(10 + i)) for i, x in enumerate(inputs)]
    encoded = [encode(x, p, gen(10 + i), gen(50 + i)) for i, x in enumerate(inputs)]
    total = ring_sum(encoded, p.bits)
    # the integers each client put in: its quantized values plus its noise share
    integers = [
        (quantize(x, p, gen(10 + i)), discrete_gaussian(p.kept, p.share_std, gen(50 + i)))
        for i, x in enumerate(inputs)
    ]
    for (q, _), q2 in zip(integers, quantized, strict=True):
        assert torch.equal(q, q2)
    exact = sum(q + z for q, z in integers)
    assert isinstance(exact, torch.Tensor)
    assert torch.equal(total, exact % p.modulus)
    lifted = decode_sum(total, p) * p.scale
    assert torch.equal(lifted.round().to(torch.int64), exact)  # no wrap: the lift is exact
    # a ring too small wraps, and still holds the sum mod 2^b exactly
    tiny = dataclasses.replace(p, bits=8)
    small = ring_sum([e & (tiny.modulus - 1) for e in encoded], tiny.bits)
    assert torch.equal(small, exact % 256)
    assert not torch.equal(decode_sum(small, tiny) * tiny.scale, exact.to(torch.float64))


@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_the_decoded_sum_is_unbiased(sigma: float) -> None:
    p = ring(sigma=sigma, kept=20000, rounding_slack=0.5)  # coarse: rounding shows
    inputs = unit_vectors(5, p.kept, 0.8, seed=2)
    encoded = [encode(x, p, gen(i), gen(100 + i)) for i, x in enumerate(inputs)]
    decoded = decode_sum(ring_sum(encoded, p.bits), p)
    error = decoded - sum(inputs)
    se = float(error.std()) / math.sqrt(p.kept)
    assert abs(float(error.mean())) < 4 * se
    if sigma == 0:  # rounding alone: variance at most 1/4 per client, in ring units
        assert 0 < float(error.var()) * p.scale**2 <= 5 / 4
    else:  # 5 noise shares of variance (s sigma C)^2 / 3, plus the rounding
        expected = 5 * discrete_gaussian_variance(p.share_std) / p.scale**2
        assert float(error.var()) == pytest.approx(expected, rel=0.05)


def test_stochastic_rounding_is_unbiased_at_a_fixed_value() -> None:
    draws = stochastic_round(torch.full((200000,), -2.3), gen(3)).to(torch.float64)
    assert set(draws.unique().tolist()) == {-3.0, -2.0}
    se = float(draws.std()) / math.sqrt(draws.numel())
    assert abs(float(draws.mean()) + 2.3) < 4 * se


def test_values_beyond_the_clip_are_scaled_back_to_it() -> None:
    p = ring(sigma=0.0, kept=4, rounding_slack=1e-4)
    q = quantize(torch.tensor([3.0, 4.0, 0.0, 0.0]), p, gen(0))  # norm 5, clip 1
    assert float(q.to(torch.float64).norm()) == pytest.approx(p.scale, rel=1e-4)
    with pytest.raises(ValueError, match="4 kept values"):
        quantize(torch.zeros(3), p, gen(0))


def test_the_wrap_rate_matches_the_gaussian_tail_and_stays_under_the_bound() -> None:
    # k=1 coordinate carrying the whole clipped norm: the signal is the worst case
    p = RingParams(clip=1.0, sigma=1.0, clients=5, threshold=3, kept=1, scale=65.0, bits=10)
    q = int(quantize(torch.tensor([1.0]), p, gen(0)))
    assert q == 65
    trials = 40000
    noise = [discrete_gaussian(trials, p.share_std, gen(100 + i)) for i in range(5)]
    inputs = [(q + z) & (p.modulus - 1) for z in noise]
    exact = 5 * q + sum(noise)
    assert isinstance(exact, torch.Tensor)
    lifted = (decode_sum(ring_sum(inputs, p.bits), p) * p.scale).round().to(torch.int64)
    wrapped = float((lifted != exact).to(torch.float64).mean())
    std = math.sqrt(5 * discrete_gaussian_variance(p.share_std))
    half = p.modulus // 2
    predicted = stats.norm.sf((half - 0.5 - 5 * q) / std) + stats.norm.cdf(
        (-half - 0.5 - 5 * q) / std
    )
    assert 0.005 < predicted < 0.05
    se = math.sqrt(predicted * (1 - predicted) / trials)
    assert abs(wrapped - predicted) < 4 * se
    assert wrapped < wrap_probability_bound(p)


# -- the noise shares -------------------------------------------------------------------------


@pytest.mark.parametrize("sigma", [0.3, 1.5, 7.0])
def test_the_discrete_gaussian_has_its_pmf_and_variance(sigma: float) -> None:
    n = 200000
    draws = discrete_gaussian(n, sigma, gen(4)).numpy()
    edge = max(2, math.ceil(4 * sigma))
    support = np.arange(-edge, edge + 1)
    w = np.exp(-(np.arange(-60 * edge, 60 * edge + 1) ** 2) / (2 * sigma**2))
    pmf = np.exp(-(support**2) / (2 * sigma**2)) / w.sum()
    pmf[0] += (1 - pmf.sum()) / 2  # the tails go to the edge bins
    pmf[-1] = 1 - pmf[:-1].sum()
    clipped = np.clip(draws, -edge, edge)
    observed = np.array([(clipped == y).sum() for y in support])
    keep = pmf * n >= 5
    chi2 = float((((observed - pmf * n) ** 2) / (pmf * n))[keep].sum())
    assert stats.chi2.sf(chi2, int(keep.sum()) - 1) > 1e-4
    var = discrete_gaussian_variance(sigma)
    y = np.arange(-60 * edge, 60 * edge + 1, dtype=np.float64)
    fourth = float((w * y**4).sum() / w.sum())
    se = math.sqrt((fourth - var**2) / n)
    assert abs(float(draws.astype(np.float64).var()) - var) < 5 * se
    assert abs(float(draws.mean())) < 5 * math.sqrt(var / n)


def test_the_discrete_gaussian_variance_formula() -> None:
    assert discrete_gaussian_variance(50.0) == pytest.approx(2500.0, rel=1e-12)
    # small sigma: almost all mass at 0, far below sigma^2
    p1 = math.exp(-1 / (2 * 0.3**2))
    p2 = math.exp(-4 / (2 * 0.3**2))
    expected = (2 * p1 + 8 * p2) / (1 + 2 * p1 + 2 * p2)
    assert discrete_gaussian_variance(0.3) == pytest.approx(expected, rel=1e-6)
    assert discrete_gaussian(10, 0.0, gen(0)).tolist() == [0] * 10


def test_the_noise_accounting_central_and_worst_case() -> None:
    p = ring(sigma=1.2, clients=10, threshold=6, kept=5000)
    assert noise_share_std(1.2, 1.0, 6) == pytest.approx(1.2 / math.sqrt(6))
    rounding = 1 + math.sqrt(p.kept) / (p.scale * p.clip)
    for m in (6, 8, 10):
        expected = 1.2 * math.sqrt(m / 6) / rounding
        assert central_noise_multiplier(p, m) == pytest.approx(expected)
    assert central_noise_multiplier(p, 6) >= 1.2 / 1.01 - 1e-12
    assert worst_case_noise_multiplier(p) == pytest.approx(1.2 / math.sqrt(6) / rounding)
    with pytest.raises(ValueError, match="fewer than the threshold"):
        central_noise_multiplier(p, 5)
    # c colluding clients subtract their own shares: m - c shares are left
    pc = ring(sigma=1.2, clients=10, threshold=7, kept=5000, colluders=2)
    expected = 1.2 * math.sqrt((9 - 2) / 7) / rounding
    assert central_noise_multiplier(pc, 9) == pytest.approx(expected)
    # the shares of m survivors sum to the noise the central multiplier claims
    m = 8
    z = sum(discrete_gaussian(p.kept, p.share_std, gen(i)) for i in range(m))
    assert isinstance(z, torch.Tensor)
    std = float(z.to(torch.float64).std()) / p.sensitivity
    assert std == pytest.approx(central_noise_multiplier(p, m), rel=0.05)
    assert sum_divergence_tau(p.share_std, 10) == 0.0  # exp underflows: no correction
    assert 0 < sum_divergence_tau(0.5, 10) < 10


@pytest.mark.parametrize(
    ("central", "clients", "threshold", "colluders", "kept"),
    [(1.0, 10, 6, 0, 5000), (0.37, 10, 7, 2, 300), (4.0, 3, 2, 0, 1), (2.5, 100, 51, 0, 3437)],
)
def test_a_ring_for_a_central_multiplier_gives_it_to_the_fewest_survivors(
    central: float, clients: int, threshold: int, colluders: int, kept: int
) -> None:
    p = ring_for_central(
        central, clip=0.5, clients=clients, threshold=threshold, kept=kept, colluders=colluders
    )
    assert (p.clients, p.threshold, p.colluders, p.kept) == (clients, threshold, colluders, kept)
    assert p == choose_ring(
        clip=0.5,
        sigma=p.sigma,
        clients=clients,
        threshold=threshold,
        kept=kept,
        colluders=colluders,
    )
    # at least central at t survivors, and no more than float64 rounding above it
    fewest = central_noise_multiplier(p, threshold)
    assert central <= fewest <= central * (1 + 1e-12)
    for m in range(threshold, clients + 1):  # more survivors carry more, by sqrt((m-c)/(t-c))
        ratio = math.sqrt((m - colluders) / (threshold - colluders))
        assert central_noise_multiplier(p, m) == pytest.approx(central * ratio, rel=1e-12)
    with pytest.raises(ValueError, match="central must be positive"):
        ring_for_central(0.0, clip=0.5, clients=clients, threshold=threshold, kept=kept)


# -- the masks --------------------------------------------------------------------------------


def test_a_mask_is_a_deterministic_uniform_expansion_of_its_seed() -> None:
    seed = bytes(range(32))
    a = expand_mask(seed, 50000, 20, b"pair")
    assert torch.equal(a, expand_mask(seed, 50000, 20, b"pair"))
    assert not torch.equal(a, expand_mask(seed, 50000, 20, b"self"))
    assert not torch.equal(a, expand_mask(bytes(32), 50000, 20, b"pair"))
    assert int(a.min()) >= 0 and int(a.max()) < 2**20
    counts = np.bincount((a >> 16).numpy(), minlength=16)  # the ring's top 4 bits
    assert stats.chisquare(counts).pvalue > 1e-4
    with pytest.raises(ValueError, match="32 bytes"):
        expand_mask(b"short", 10, 20, b"pair")


def test_pairwise_masks_cancel_and_the_self_masks_come_off() -> None:
    bits, k, ids = 18, 300, [3, 9, 14, 20]
    inputs = {i: torch.randint(0, 2**bits, (k,), generator=gen(i)) for i in ids}
    pair = {(a, b): bytes([a, b]) * 16 for a in ids for b in ids if a < b}
    seeds = {i: bytes([i]) * 32 for i in ids}

    def masked(i: int, others: list[int]) -> torch.Tensor:
        ps = {j: pair[min(i, j), max(i, j)] for j in others}
        return mask_input(inputs[i], i, ps, seeds[i], bits)

    ys = {i: masked(i, [j for j in ids if j != i]) for i in ids}
    assert all(not torch.equal(ys[i], inputs[i]) for i in ids)
    total = remove_masks(ring_sum(ys.values(), bits), seeds.values(), [], bits)
    assert torch.equal(total, ring_sum(inputs.values(), bits))
    # node 20 dropped after masking with everyone: its pair masks come off by their seeds
    live = [3, 9, 14]
    dropped = [(j, 20, pair[j, 20]) for j in live]
    total = remove_masks(
        ring_sum([ys[i] for i in live], bits), [seeds[i] for i in live], dropped, bits
    )
    assert torch.equal(total, ring_sum([inputs[i] for i in live], bits))


def test_ring_vectors_pack_to_whole_bytes_and_back() -> None:
    for bits in (8, 17, 62):
        v = torch.randint(0, 2**bits if bits < 62 else 2**62, (257,), generator=gen(bits))
        data = pack_ring(v, bits)
        assert len(data) == 257 * ((bits + 7) // 8)
        assert torch.equal(unpack_ring(data, 257, bits), v)
    with pytest.raises(ValueError, match="expected 771 bytes"):
        unpack_ring(b"\0" * 770, 257, 17)
    with pytest.raises(ValueError, match="not below 2\\^17"):
        unpack_ring(b"\xff" * 771, 257, 17)
