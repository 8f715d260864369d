"""DP-FedAvg (user-level central DP, common/dp/central.py): clip, fixed denominator, noise on
the public support only, Poisson sampling of users, and the accountant over rounds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedsparse.common.config import FederatedConfig
from fedsparse.common.dp.accounting import compute_epsilon_of_history
from fedsparse.common.dp.central import (
    calibrate_central_noise,
    central_aggregate,
    central_noise_generator,
    poisson_sample,
    user_level_epsilon,
    user_sample_rate,
)


def _gen(seed: int = 0) -> torch.Generator:
    return central_noise_generator("seeded", seed=seed)


def test_noise_free_aggregate_by_hand() -> None:
    """Each update is clipped to S, summed, and divided by q N (not by who answered)."""
    w = torch.zeros(6)
    support = torch.tensor([1, 2, 4])
    u1 = (torch.tensor([3.0, 4.0, 0.0]), support)  # norm 5 -> scaled to 1: (0.6, 0.8, 0)
    u2 = (torch.tensor([0.0, 0.0, 0.5]), support)  # norm 0.5: unchanged
    new, touched = central_aggregate(
        w,
        [u1, u2],
        support=support,
        clip=1.0,
        noise_multiplier=0.0,
        expected_users=4.0,
        generator=_gen(),
    )
    expected = torch.tensor([0.0, 0.6, 0.8, 0.0, 0.5, 0.0]) / 4
    torch.testing.assert_close(new, expected)
    assert touched.tolist() == [False, True, True, False, True, False]


@pytest.mark.parametrize("norm", [0.1, 3.0, 1e6])
def test_one_users_influence_is_at_most_s_over_qn(norm: float) -> None:
    """The sensitivity of the (noise-free) round to adding or removing one user."""
    g = torch.Generator().manual_seed(1)
    others = [(torch.randn(50, generator=g), None) for _ in range(3)]
    user = torch.randn(50, generator=g)
    user = user / user.norm() * norm
    args = dict(support=None, clip=0.5, noise_multiplier=0.0, expected_users=8.0)
    w = torch.zeros(50)
    without, _ = central_aggregate(w, others, generator=_gen(), **args)  # type: ignore[arg-type]
    with_user, _ = central_aggregate(w, [*others, (user, None)], generator=_gen(), **args)  # type: ignore[arg-type]
    assert float((with_user - without).norm()) <= 0.5 / 8.0 * (1 + 1e-6)


@pytest.mark.parametrize("secure", [False, True])
def test_noise_is_on_the_support_only_with_std_sigma_s_over_qn(secure: bool) -> None:
    d, sigma, s, m = 20000, 2.0, 0.5, 5.0
    support = torch.arange(0, d, 2)
    new, _ = central_aggregate(
        torch.zeros(d),
        [],
        support=support,
        clip=s,
        noise_multiplier=sigma,
        expected_users=m,
        generator=_gen(3),
        secure=secure,
    )
    off = torch.ones(d, dtype=torch.bool)
    off[support] = False
    assert torch.count_nonzero(new[off]) == 0
    std = float(new[support].std())
    target = sigma * s / m
    # the sample std of n normals has relative SE 1 / sqrt(2 (n - 1))
    assert abs(std / target - 1) < 5 / math.sqrt(2 * (len(support) - 1))


def test_secure_noise_is_the_hardened_sum_of_four_draws() -> None:
    """secure-mode: one draw discarded, then (z1 + z2 + z3 + z4) / 2 per coordinate (Opacus's
    hardened noise), so the stream is not the plain one's."""
    d, sigma, s = 1000, 1.5, 2.0
    args = dict(support=None, clip=s, noise_multiplier=sigma, expected_users=1.0)
    secure, _ = central_aggregate(torch.zeros(d), [], generator=_gen(7), secure=True, **args)  # type: ignore[arg-type]
    plain, _ = central_aggregate(torch.zeros(d), [], generator=_gen(7), **args)  # type: ignore[arg-type]
    g = _gen(7)
    torch.normal(0.0, sigma * s, size=(1, 1), generator=g)  # the discarded first draw
    draws = [torch.normal(0.0, sigma * s, size=(d,), generator=g) for _ in range(4)]
    torch.testing.assert_close(secure, (draws[0] + draws[1] + draws[2] + draws[3]) / 2)
    assert not torch.equal(secure, plain)


def test_secure_mode_refuses_seeded_central_noise() -> None:
    with pytest.raises(ValueError, match="central-noise='fresh' with secure-mode=true"):
        FederatedConfig(
            dp_level="user", clients_per_round=2, secure_mode=True, central_noise="seeded"
        )
    FederatedConfig(dp_level="user", clients_per_round=2, secure_mode=True)  # fresh: accepted


def test_updates_off_the_public_support_are_refused() -> None:
    with pytest.raises(ValueError, match="off the round's public support"):
        central_aggregate(
            torch.zeros(4),
            [(torch.ones(2), torch.tensor([0, 3]))],
            support=torch.tensor([0, 1]),
            clip=1.0,
            noise_multiplier=1.0,
            expected_users=1.0,
            generator=_gen(),
        )


@pytest.mark.parametrize("where", [[1, 1], [2, 0]], ids=["repeated", "decreasing"])
def test_a_support_not_strictly_increasing_is_refused(where: list[int]) -> None:
    """The exact sum adds at distinct indices: a repeated one would count an update once."""
    with pytest.raises(ValueError, match="not strictly increasing"):
        central_aggregate(
            torch.zeros(4),
            [(torch.ones(2), torch.tensor(where))],
            support=None,
            clip=1.0,
            noise_multiplier=1.0,
            expected_users=1.0,
            generator=_gen(),
        )


def test_the_clipped_sum_is_the_same_in_any_order() -> None:
    """Bit for bit: updates whose float64 sums in arrival order would differ."""
    updates = [
        (torch.tensor([2.0**60, 1.0, -3.0], dtype=torch.float32), None),
        (torch.tensor([1.0, 2.0**-40], dtype=torch.float32), torch.tensor([0, 2])),
        (torch.tensor([-(2.0**60), -1.0, 5.0], dtype=torch.float32), None),
    ]
    results = {
        central_aggregate(
            torch.zeros(3),
            [updates[k] for k in order],
            support=None,
            clip=1e30,
            noise_multiplier=0.0,
            expected_users=3.0,
            generator=_gen(),
        )[0]
        .numpy()
        .tobytes()
        for order in ([0, 1, 2], [0, 2, 1], [2, 1, 0], [1, 0, 2])
    }
    assert len(results) == 1


def test_poisson_sampling_rate() -> None:
    """Each node independently with probability q: the count is Binomial(N, q)."""
    rng = np.random.default_rng(0)
    nodes = list(range(100))
    counts = [len(poisson_sample(nodes, 0.3, rng)) for _ in range(2000)]
    se = math.sqrt(100 * 0.3 * 0.7 / 2000)
    assert abs(np.mean(counts) - 30) < 5 * se
    assert user_sample_rate(3, 12) == 0.25
    assert user_sample_rate(13, 12) == 1.0  # fewer nodes than expected users: all join
    with pytest.raises(ValueError, match="clients-per-round=0"):
        user_sample_rate(0, 12)


def test_user_level_epsilon_is_the_accountants() -> None:
    eps = user_level_epsilon(noise_multiplier=1.1, sample_rate=0.1, rounds=50, delta=1e-5)
    assert eps == compute_epsilon_of_history([(1.1, 0.1, 50)], delta=1e-5, accountant="rdp")
    fewer = user_level_epsilon(noise_multiplier=1.1, sample_rate=0.1, rounds=10, delta=1e-5)
    assert 0 < fewer < eps
    assert user_level_epsilon(noise_multiplier=0.0, sample_rate=0.1, rounds=1, delta=1e-5) == (
        math.inf
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(method="gip"), "dp-level='user'"),
        (dict(mask_scope="client"), "mask-scope='round'"),
        (dict(aggregator="median"), "aggregator='mean'"),
        (dict(central_clip=0.0), "central-clip=0.0"),
        (dict(clients_per_round=0), "clients-per-round >= 1"),
        (dict(central_target_epsilon=-1.0), "central-target-epsilon=-1.0"),
        (dict(central_target_epsilon=math.nan), "central-target-epsilon=nan"),
    ],
)
def test_user_level_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FederatedConfig(dp_level="user", **{"clients_per_round": 2, **kwargs})


def test_a_target_needs_user_level_dp() -> None:
    with pytest.raises(ValueError, match="central-target-epsilon=2.0: expected 0 .off.*dp-level"):
        FederatedConfig(central_target_epsilon=2.0)


def test_a_target_is_taken_under_secure_aggregation() -> None:
    cfg = FederatedConfig(
        central_target_epsilon=2.0, dp_level="user", secure_aggregation=True, clients_per_round=5
    )
    assert cfg.central_target_epsilon == 2.0 and cfg.secure_aggregation


@pytest.mark.parametrize(
    ("target", "rate", "rounds"),
    [(3.0, 0.5, 3), (1.0, 0.1, 40), (8.0, 1.0, 10), (0.5, 0.01, 1000)],
)
def test_a_calibrated_central_sigma_spends_its_target_within_a_tenth_of_a_percent(
    target: float, rate: float, rounds: int
) -> None:
    sigma = calibrate_central_noise(
        target_epsilon=target, sample_rate=rate, rounds=rounds, delta=1e-5
    )
    spent = user_level_epsilon(noise_multiplier=sigma, sample_rate=rate, rounds=rounds, delta=1e-5)
    assert target * (1 - 1e-3) <= spent <= target
    # a round more than planned spends more (the target holds for num-rounds rounds)
    more = user_level_epsilon(
        noise_multiplier=sigma, sample_rate=rate, rounds=rounds + 1, delta=1e-5
    )
    assert more > spent


def test_a_central_sigma_is_raised_only_where_the_history_needs_it() -> None:
    # 10 rounds planned at q = 0.01, 5 run; then q = 0.2 for the 5 left
    sigma = calibrate_central_noise(target_epsilon=2.0, sample_rate=0.01, rounds=10, delta=1e-5)
    history = [(sigma, 0.01, 5)]
    raised = calibrate_central_noise(
        target_epsilon=2.0, sample_rate=0.2, rounds=5, delta=1e-5, history=history, sigma=sigma
    )
    total = compute_epsilon_of_history([*history, (raised, 0.2, 5)], delta=1e-5, accountant="rdp")
    assert raised > sigma and 2.0 * (1 - 1e-3) <= total <= 2.0
    # at the planned rate the run's sigma still fits: kept as it is
    kept = calibrate_central_noise(
        target_epsilon=2.0, sample_rate=0.01, rounds=5, delta=1e-5, history=history, sigma=sigma
    )
    assert kept == sigma
