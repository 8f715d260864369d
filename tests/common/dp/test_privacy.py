"""Tests for the accounting glue (fedsparse.common.dp.accounting): q, steps, σ calibration,
records."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.accountants.utils import get_noise_multiplier
from torch import nn

from fedsparse.common.data.datasets import load_dataset
from fedsparse.common.data.partition import partition_indices
from fedsparse.common.dp.accounting import (
    ACCOUNTANTS,
    HISTORY_KEYS,
    calibrate_noise_multiplier,
    compute_epsilon,
    compute_epsilon_of_history,
    history_from_record,
    history_to_record,
    sample_rate,
    steps_per_epoch,
)
from fedsparse.common.dp.engine import SparseDPEngine
from fedsparse.common.training.configs import PrivacyConfig, TrainConfig
from fedsparse.common.training.local import make_private, train_one_epoch

pytestmark = [
    pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha:UserWarning"),
    pytest.mark.filterwarnings("ignore:GDP accounting is experimental:UserWarning"),
]

DELTA = 1e-5


def tiny_private(
    n: int, batch_size: int, *, privacy: PrivacyConfig, epochs_for_target: int = 1, **train
) -> tuple[SparseDPEngine, nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader]:
    """``make_private`` on a 4 -> 2 linear model and ``n`` random examples."""
    g = torch.Generator().manual_seed(n)
    x, y = torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)
    return make_private(
        nn.Linear(4, 2),
        x,
        y,
        privacy=privacy,
        train=TrainConfig(batch_size=batch_size, **train),
        epochs_for_target=epochs_for_target,
    )


# -- sampling rate and step count ------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "batch_size", "batches", "steps"),
    [
        (143, 32, 5, 5),
        (144, 32, 5, 5),
        (160, 32, 5, 5),
        (161, 32, 6, 6),
        (10, 32, 1, 1),  # batch larger than the data: one batch of everything
        (2400, 32, 75, 75),
        (93, 1, 93, 92),  # int(1 / (1/93)) = 92: Opacus's sampler runs one batch fewer
        (2976, 32, 93, 92),
    ],
)
def test_sample_rate_and_steps_per_epoch(n: int, batch_size: int, batches: int, steps: int) -> None:
    assert steps_per_epoch(n, batch_size) == steps
    assert sample_rate(n, batch_size) == 1 / steps
    assert steps_per_epoch(n, batch_size, poisson_sampling=False) == batches
    assert sample_rate(n, batch_size, poisson_sampling=False) == 1 / batches


@pytest.mark.parametrize(
    ("n", "batch_size", "poisson_sampling"),
    [(143, 32, True), (37, 8, True), (93, 1, True), (10, 32, True), (93, 1, False)],
)
def test_steps_per_epoch_is_what_an_epoch_runs(
    n: int, batch_size: int, poisson_sampling: bool
) -> None:
    """Measured: the accountant's history after one real epoch of ``train_one_epoch``."""
    privacy = PrivacyConfig(noise_multiplier=1.0)
    engine, module, optimizer, loader = tiny_private(
        n, batch_size, privacy=privacy, poisson_sampling=poisson_sampling
    )
    _, examples = train_one_epoch(module, optimizer, loader)
    expected = steps_per_epoch(n, batch_size, poisson_sampling=poisson_sampling)
    q = sample_rate(n, batch_size, poisson_sampling=poisson_sampling)
    assert len(loader) == expected
    assert engine.accountant.history == [(1.0, q, expected)]
    if not poisson_sampling:
        assert examples == n


# -- calibration -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_client_sizes() -> list[int]:
    """Partition sizes of the default federated run: digits, 10 IID clients."""
    train, _ = load_dataset("digits", seed=0)
    parts = partition_indices(train.y.numpy(), num_partitions=10, partitioner="iid", seed=0)
    return sorted({len(p) for p in parts})


def test_calibrated_sigma_meets_the_target_on_the_digits_setting(
    digits_client_sizes: list[int],
) -> None:
    assert digits_client_sizes == [143, 144]  # 1437 training images over 10 clients
    rounds, local_epochs, batch_size, target = 10, 1, 32, 3.0
    settings = {
        (sample_rate(n, batch_size), rounds * local_epochs * steps_per_epoch(n, batch_size))
        for n in digits_client_sizes
    }
    assert settings == {(0.2, 50)}  # every client: 5 batches of ~29 expected, 50 steps
    for q, steps in settings:
        sigma = calibrate_noise_multiplier(
            target_epsilon=target, delta=DELTA, sample_rate=q, steps=steps, accountant="rdp"
        )
        eps = compute_epsilon(
            noise_multiplier=sigma, sample_rate=q, steps=steps, delta=DELTA, accountant="rdp"
        )
        assert target - 0.01 <= eps <= target
        assert sigma == pytest.approx(2.412109375, abs=1e-12)  # pinned
        # Here Opacus's epochs-based count agrees (int(10 / 0.2) = 50): its σ, bit for bit.
        assert sigma == get_noise_multiplier(
            target_epsilon=target, target_delta=DELTA, sample_rate=q, epochs=10
        )


@pytest.mark.parametrize(
    "accountant",
    [a if a != "prv" else pytest.param(a, marks=pytest.mark.slow) for a in ACCOUNTANTS],
)
def test_calibration_is_opacus_search_on_exact_steps(accountant: str) -> None:
    q, steps, target = 0.2, 50, 3.0
    sigma = calibrate_noise_multiplier(
        target_epsilon=target, delta=DELTA, sample_rate=q, steps=steps, accountant=accountant
    )
    eps = compute_epsilon(
        noise_multiplier=sigma, sample_rate=q, steps=steps, delta=DELTA, accountant=accountant
    )
    assert target - 0.01 <= eps <= target
    # A slightly smaller σ would overspend: σ is (to the search's resolution) the smallest.
    assert (
        compute_epsilon(
            noise_multiplier=sigma * 0.99,
            sample_rate=q,
            steps=steps,
            delta=DELTA,
            accountant=accountant,
        )
        > eps
    )
    assert sigma == get_noise_multiplier(
        target_epsilon=target,
        target_delta=DELTA,
        sample_rate=q,
        steps=steps,
        accountant=accountant,
    )


def test_opacus_epochs_calibration_is_one_step_short_and_ours_is_not() -> None:
    """q = 1/75 (2400 examples, batch 32), 3 epochs: Opacus calibrates 224 steps, 225 run."""
    q, epochs, target = sample_rate(2400, 32), 3, 3.0
    run_steps = epochs * steps_per_epoch(2400, 32)
    assert (int(epochs / q), run_steps) == (224, 225)

    opacus_sigma = get_noise_multiplier(
        target_epsilon=target, target_delta=DELTA, sample_rate=q, epochs=epochs
    )
    opacus_eps = compute_epsilon(
        noise_multiplier=opacus_sigma, sample_rate=q, steps=run_steps, delta=DELTA, accountant="rdp"
    )
    assert opacus_sigma == pytest.approx(0.799560546875, abs=1e-12)
    assert opacus_eps == pytest.approx(3.00177, abs=1e-5)
    assert opacus_eps > target

    sigma = calibrate_noise_multiplier(
        target_epsilon=target, delta=DELTA, sample_rate=q, steps=run_steps, accountant="rdp"
    )
    eps = compute_epsilon(
        noise_multiplier=sigma, sample_rate=q, steps=run_steps, delta=DELTA, accountant="rdp"
    )
    assert sigma == pytest.approx(0.8001708984375, abs=1e-12)
    assert target - 0.01 <= eps <= target


@pytest.mark.slow
def test_make_private_with_a_target_spends_at_most_the_target_over_the_run() -> None:
    """End to end, centralized path: 75 examples, batch 1 (q = 1/75), 3 epochs = 225 steps."""
    target, epochs = 3.0, 3
    privacy = PrivacyConfig(target_epsilon=target, delta=DELTA)
    engine, module, optimizer, loader = tiny_private(
        75, 1, privacy=privacy, epochs_for_target=epochs, epochs=epochs, lr=0.01
    )
    for _ in range(epochs):
        train_one_epoch(module, optimizer, loader)
    ((sigma, q, steps),) = engine.accountant.history
    assert (q, steps) == (1 / 75, 225)
    assert sigma == calibrate_noise_multiplier(
        target_epsilon=target, delta=DELTA, sample_rate=q, steps=225, accountant="rdp"
    )
    assert target - 0.01 <= engine.get_epsilon(DELTA) <= target

    # Opacus's make_private_with_epsilon on the same loader calibrates for 224 steps.
    opacus, model = SparseDPEngine(), nn.Linear(4, 2)
    opacus.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        data_loader=torch.utils.data.DataLoader(loader.dataset, batch_size=1),
        target_epsilon=target,
        target_delta=DELTA,
        epochs=epochs,
        max_grad_norm=1.0,
    )
    opacus_sigma = opacus.optimizer.noise_multiplier
    assert opacus_sigma < sigma
    assert (
        compute_epsilon(
            noise_multiplier=opacus_sigma, sample_rate=q, steps=225, delta=DELTA, accountant="rdp"
        )
        > target
    )


def test_make_private_with_a_target_keeps_opacus_sigma_where_the_counts_agree() -> None:
    privacy = PrivacyConfig(target_epsilon=3.0, delta=DELTA)
    _, _, optimizer, _ = tiny_private(143, 32, privacy=privacy, epochs_for_target=10)
    assert optimizer.noise_multiplier == get_noise_multiplier(  # type: ignore[attr-defined]
        target_epsilon=3.0, target_delta=DELTA, sample_rate=0.2, epochs=10
    )


def test_gdp_calibration_where_opacus_search_fails() -> None:
    """Opacus's GDP solver looks for ε in [0, 500] only; its search visits σ with ε > 500."""
    q, steps, target = 1 / 75, 225, 3.0
    with pytest.raises(ValueError, match="different signs"):
        get_noise_multiplier(
            target_epsilon=target, target_delta=DELTA, sample_rate=q, steps=steps, accountant="gdp"
        )

    def gdp_epsilon(sigma: float) -> float:
        return compute_epsilon(
            noise_multiplier=sigma, sample_rate=q, steps=steps, delta=DELTA, accountant="gdp"
        )

    assert gdp_epsilon(0.3) == math.inf  # mu ~ 51: no ε <= 500 meets δ
    assert gdp_epsilon(1e5) == 0.0  # mu ~ 2e-6: δ(ε = 0) < δ already
    assert 0 < gdp_epsilon(20.0) < 0.03
    sigma = calibrate_noise_multiplier(
        target_epsilon=target, delta=DELTA, sample_rate=q, steps=steps, accountant="gdp"
    )
    eps = compute_epsilon(
        noise_multiplier=sigma, sample_rate=q, steps=steps, delta=DELTA, accountant="gdp"
    )
    assert target - 0.01 <= eps <= target


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target_epsilon": 0.0}, r"^target_epsilon=0\.0: expected a finite value > 0$"),
        ({"target_epsilon": math.inf}, r"^target_epsilon=inf: expected"),
        ({"delta": 1.0}, r"^delta=1\.0: expected 0 < delta < 1$"),
        ({"sample_rate": 0.0}, r"^sample_rate=0\.0: expected 0 < q <= 1$"),
        ({"sample_rate": 1.5}, r"^sample_rate=1\.5: expected"),
        ({"steps": 0}, r"^steps=0: expected an integer >= 1$"),
        ({"steps": 2.0}, r"^steps=2\.0: expected an integer >= 1$"),
        ({"accountant": "moments"}, r"^accountant='moments': expected one of rdp, prv, gdp$"),
        ({"epsilon_tolerance": -1.0}, r"^epsilon_tolerance=-1\.0: expected"),
        ({"target_epsilon": 1e-9}, r"^target_epsilon=1e-09: unreachable"),
    ],
)
def test_calibration_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    args = dict(target_epsilon=3.0, delta=DELTA, sample_rate=0.2, steps=50, accountant="rdp")
    with pytest.raises(ValueError, match=match):
        calibrate_noise_multiplier(**{**args, **kwargs})


@pytest.mark.parametrize(
    ("n", "batch_size", "match"),
    [(0, 32, r"^num_examples=0: expected"), (10, 0, r"^batch_size=0: expected")],
)
def test_step_helpers_reject_bad_sizes(n: int, batch_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        steps_per_epoch(n, batch_size)


# -- accountant history <-> record ---------------------------------------------------------------


def test_history_record_layout_is_the_clients() -> None:
    """The layout the client has stored in Context.state: a leading (0, 0, 0) entry."""
    record = history_to_record([(1.25, 0.2, 5), (1.25, 0.2, 10)])
    assert record == {
        "acc-sigma": [0.0, 1.25, 1.25],
        "acc-q": [0.0, 0.2, 0.2],
        "acc-steps": [0, 5, 10],
    }
    assert list(record) == list(HISTORY_KEYS)
    assert [type(v) for v in record["acc-sigma"]] == [float] * 3
    assert [type(v) for v in record["acc-q"]] == [float] * 3
    assert [type(v) for v in record["acc-steps"]] == [int] * 3
    assert history_to_record([]) == {"acc-sigma": [0.0], "acc-q": [0.0], "acc-steps": [0]}
    # numpy scalars (what an accountant may hold) are stored as plain Python numbers
    record = history_to_record([(np.float64(1.5), np.float32(0.25), np.int64(3))])
    assert [type(v) for v in record["acc-sigma"] + record["acc-q"] + record["acc-steps"]] == [
        float,
        float,
        float,
        float,
        int,
        int,
    ]


def test_history_record_fits_a_flower_config_record() -> None:
    flwr_records = pytest.importorskip("flwr.app")
    history = [(1.1, 0.2, 5)]
    stored = flwr_records.ConfigRecord({"version": 3, **history_to_record(history)})
    assert history_from_record(stored) == history


finite_sigma = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
rate = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
entry = st.tuples(finite_sigma, rate, st.integers(min_value=1, max_value=2**62))


@settings(derandomize=True, max_examples=200)
@given(st.lists(entry, max_size=20))
def test_history_round_trips(history: list[tuple[float, float, int]]) -> None:
    record = history_to_record(history)
    assert all(len(column) == len(history) + 1 for column in record.values())
    assert history_from_record(record) == history


@settings(derandomize=True, max_examples=100)
@given(st.lists(st.tuples(finite_sigma, rate, st.integers(min_value=0, max_value=10)), min_size=1))
def test_history_from_record_skips_exactly_the_zero_step_entries(
    rows: list[tuple[float, float, int]],
) -> None:
    record = {key: [row[i] for row in rows] for i, key in enumerate(HISTORY_KEYS)}
    assert history_from_record(record) == [row for row in rows if row[2] > 0]


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"acc-q": [0.0], "acc-steps": [0]}, r"^acc-sigma: missing"),
        ({"acc-sigma": 1.0, "acc-q": [0.0], "acc-steps": [0]}, r"^acc-sigma=1\.0: expected a list"),
        ({"acc-sigma": [0.0], "acc-q": "0", "acc-steps": [0]}, r"^acc-q='0': expected a list"),
        (
            {"acc-sigma": [0.0, 1.0], "acc-q": [0.0], "acc-steps": [0, 1]},
            r"^acc-q: 1 entries, expected 2 \(as many as acc-sigma\)$",
        ),
        (
            {"acc-sigma": [0.0, 1.0], "acc-q": [0.0, 0.1], "acc-steps": [0]},
            r"^acc-steps: 1 entries, expected 2",
        ),
        (
            {"acc-sigma": [0.0, math.nan], "acc-q": [0.0, 0.1], "acc-steps": [0, 1]},
            r"^acc-sigma\[1\]=nan: expected a finite value >= 0$",
        ),
        (
            {"acc-sigma": [-1.0], "acc-q": [0.1], "acc-steps": [1]},
            r"^acc-sigma\[0\]=-1\.0: expected",
        ),
        (
            {"acc-sigma": [math.inf], "acc-q": [0.1], "acc-steps": [1]},
            r"^acc-sigma\[0\]=inf: expected",
        ),
        ({"acc-sigma": [1.0], "acc-q": [1.5], "acc-steps": [1]}, r"^acc-q\[0\]=1\.5: expected"),
        ({"acc-sigma": [1.0], "acc-q": [-0.1], "acc-steps": [1]}, r"^acc-q\[0\]=-0\.1: expected"),
        ({"acc-sigma": [1.0], "acc-q": [0.1], "acc-steps": [-1]}, r"^acc-steps\[0\]=-1: expected"),
        ({"acc-sigma": [1.0], "acc-q": [0.1], "acc-steps": [1.0]}, r"^acc-steps\[0\]=1\.0: expect"),
        ({"acc-sigma": [1.0], "acc-q": [0.1], "acc-steps": [True]}, r"^acc-steps\[0\]=True: "),
        ({"acc-sigma": ["1"], "acc-q": [0.1], "acc-steps": [1]}, r"^acc-sigma\[0\]='1': expect"),
    ],
)
def test_history_from_record_rejects_malformed_records(record: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        history_from_record(record)


@pytest.mark.parametrize(
    ("history", "match"),
    [
        ([(1.0, 0.1, 0)], r"^acc-steps\[0\]=0: expected an integer >= 1$"),
        ([(1.0, 0.1)], r"^history\[0\]=\(1\.0, 0\.1\): expected \(sigma, q, steps\)$"),
        ([(1.0, 0.1, 1), (math.nan, 0.1, 1)], r"^acc-sigma\[1\]=nan: expected"),
        ([(1.0, 2.0, 1)], r"^acc-q\[0\]=2\.0: expected"),
    ],
)
def test_history_to_record_rejects_malformed_history(history: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        history_to_record(history)


def test_gdp_composes_a_history_of_several_sigmas_and_rates() -> None:
    """Opacus's GaussianAccountant reads its last entry alone; the history's epsilon is
    the mu-GDP of mu^2 = sum q^2 T (e^{1/sigma^2} - 1), and one (sigma, q) split in two
    entries is the same as one entry."""
    import warnings

    from opacus.accountants.analysis.gdp import compute_mu_poisson, eps_from_mu

    warnings.simplefilter("ignore")
    history = [(1.0, 0.05, 5), (2.0, 0.1, 7), (1.0, 0.05, 3)]
    mu = math.sqrt(
        compute_mu_poisson(steps=8, noise_multiplier=1.0, sample_rate=0.05) ** 2
        + compute_mu_poisson(steps=7, noise_multiplier=2.0, sample_rate=0.1) ** 2
    )
    got = compute_epsilon_of_history(history, delta=1e-5, accountant="gdp")
    assert got == pytest.approx(eps_from_mu(mu=mu, delta=1e-5), rel=1e-9)
    last_only = compute_epsilon_of_history([history[-1]], delta=1e-5, accountant="gdp")
    assert got > last_only
    split = compute_epsilon_of_history(
        [(1.0, 0.05, 4), (1.0, 0.05, 6)], delta=1e-5, accountant="gdp"
    )
    whole = compute_epsilon_of_history([(1.0, 0.05, 10)], delta=1e-5, accountant="gdp")
    assert split == whole
