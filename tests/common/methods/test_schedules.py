"""Tests for fedsparse.common.methods.schedules."""

import math

import pytest

from fedsparse.common.methods.schedules import RateSchedule


def test_gradual_cooling_matches_rs_paper() -> None:
    s = RateSchedule(kind="gradual", final_rate=0.9, total_steps=10)
    assert s.rates() == pytest.approx([0.9 * e / 9 for e in range(10)])
    assert s.rate(0) == 0.0 and s.rate(9) == pytest.approx(0.9)


def test_gradual_single_step_reaches_final_rate() -> None:
    assert RateSchedule(kind="gradual", final_rate=0.5, total_steps=1).rates() == [0.5]


def test_cooling_time() -> None:
    s = RateSchedule(kind="cooling", final_rate=0.8, total_steps=8, cooling_steps=4)
    assert s.rates() == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 0.8, 0.8, 0.8])


def test_constant() -> None:
    assert RateSchedule(kind="constant", final_rate=0.3, total_steps=3).rates() == [0.3] * 3


def test_gip_keep_decays() -> None:
    lin = RateSchedule(kind="linear-keep", initial_keep=1.0, final_keep=0.1, total_steps=4)
    assert lin.rates() == pytest.approx([0.0, 0.3, 0.6, 0.9])
    exp = RateSchedule(kind="exp-keep", initial_keep=1.0, final_keep=0.5, total_steps=3)
    assert [1 - r for r in exp.rates()] == pytest.approx([1.0, math.sqrt(0.5), 0.5])


def test_mean_density() -> None:
    s = RateSchedule(kind="gradual", final_rate=0.9, total_steps=10)
    assert s.mean_density() == pytest.approx(1 - 0.45)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "cosine"}, "kind='cosine'"),
        ({"final_rate": 1.0}, "final_rate=1.0"),
        ({"final_rate": -0.1}, "final_rate=-0.1"),
        ({"total_steps": 0}, "total_steps=0"),
        ({"cooling_steps": 0}, "cooling_steps=0"),
        ({"final_keep": 0.0}, "final_keep=0.0"),
    ],
)
def test_validation_names_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RateSchedule(**kwargs)


def test_step_out_of_range() -> None:
    with pytest.raises(ValueError, match="step=5"):
        RateSchedule(total_steps=5).rate(5)


def test_steps_schedule_visits_the_given_rates_and_repeats_the_last() -> None:
    schedule = RateSchedule(kind="steps", steps=(0.0, 0.5, 0.7, 0.9), total_steps=6)
    assert schedule.rates() == [0.0, 0.5, 0.7, 0.9, 0.9, 0.9]
    with pytest.raises(ValueError, match="needs at least one rate"):
        RateSchedule(kind="steps", total_steps=2)
    with pytest.raises(ValueError, match="each rate must satisfy"):
        RateSchedule(kind="steps", steps=(0.5, 1.0), total_steps=2)


def test_steps_schedule_from_the_run_config() -> None:
    from fedsparse.common.config import FederatedConfig

    cfg = FederatedConfig.from_run_config(
        {"schedule": "steps", "rate-steps": "0, 0.5,0.9", "num-rounds": 3}
    )
    assert cfg.sparsity().rate_schedule(3).rates() == [0.0, 0.5, 0.9]
    with pytest.raises(ValueError, match=r"^rate-steps=\(0\.0, 1\.5\): each rate"):
        FederatedConfig.from_run_config({"schedule": "steps", "rate-steps": "0,1.5"})
    with pytest.raises(ValueError, match=r"^rate-steps='a,b': expected comma-separated"):
        FederatedConfig.from_run_config({"schedule": "steps", "rate-steps": "a,b"})
