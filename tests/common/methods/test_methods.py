"""``method``: random freeze's schedule and total density, layer freezing's exact zero update.

Centralized runs on digits (1,437 training images, the ``digits-cnn`` model), a few epochs.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedsparse.common.config import FederatedConfig
from fedsparse.common.data.datasets import load_dataset
from fedsparse.common.dp.accounting import compute_epsilon, sample_rate, steps_per_epoch
from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import keep_count
from fedsparse.common.methods import (
    MethodConfig,
    frozen_prefix,
    layer_ranges,
    layerwise_keep,
    layerwise_mask,
    method_schedule,
    public_split,
    ranked_mask,
    suffix_mask,
    total_density,
)
from fedsparse.common.methods.schedules import RateSchedule
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.training.centralized import train_centralized
from fedsparse.common.training.configs import PrivacyConfig, SparsityConfig, TrainConfig


def _layout(name: str = "dpcnn-mnist") -> ParamLayout:
    return ParamLayout.from_module(build_model(name, seed=0))


def test_a_layer_is_a_module_with_its_weight_and_bias() -> None:
    layout = _layout()
    assert layer_ranges(layout) == [
        ("features.0", 0, 16 * 1 * 8 * 8 + 16),
        ("features.3", 1040, 1040 + 32 * 16 * 4 * 4 + 32),
        ("classifier.1", 9264, 9264 + 32 * 512 + 32),
        ("classifier.3", 25680, 25680 + 10 * 32 + 10),
    ]
    assert frozen_prefix(layout, 0) == 0
    assert frozen_prefix(layout, 2) == 9264


@pytest.mark.parametrize("m_f", [-1, 4, 9])
def test_freezing_every_layer_is_refused_naming_the_layers(m_f: int) -> None:
    with pytest.raises(ValueError, match=rf"freeze-layers={m_f}: expected 0 <= m_f < 4 .*"):
        frozen_prefix(_layout(), m_f)


def test_lf_freezes_from_step_t_f_on() -> None:
    layout = _layout()
    method = MethodConfig(name="lf", freeze_layers=2, freeze_after=3)
    assert [method.frozen(layout, step) for step in range(6)] == [0, 0, 0, 9264, 9264, 9264]
    assert MethodConfig(name="rs").frozen(layout, 10) == 0
    mask = suffix_mask(layout.numel, 9264)
    assert mask is not None and int(mask.sum()) == layout.numel - 9264 and not mask[:9264].any()
    assert suffix_mask(layout.numel, 0) is None


def test_random_freeze_is_the_cooling_schedule() -> None:
    assert method_schedule("random-freeze", "gradual") == "cooling"
    assert method_schedule("random-freeze", "cooling") == "cooling"
    assert method_schedule("rs", "constant") == "constant"
    with pytest.raises(ValueError, match="schedule='constant': method='random-freeze' ramps"):
        method_schedule("random-freeze", "constant")
    with pytest.raises(ValueError, match="schedule='exp-keep': method='random-freeze'"):
        FederatedConfig(method="random-freeze", schedule="exp-keep")
    cfg = FederatedConfig(method="random-freeze", final_rate=0.9, cooling_rounds=4, num_rounds=10)
    schedule = cfg.sparsity().rate_schedule(cfg.num_rounds)
    # r(e) = r* min(e / e*, 1): the random-freeze paper's Algorithm 1, line 2.
    assert [schedule.rate(e) for e in range(10)] == pytest.approx(
        [0.9 * min(e / 4, 1) for e in range(10)], abs=1e-12
    )


def test_total_density_is_kept_over_dense() -> None:
    d, rates = 10_000, [0.9 * min(e / 4, 1) for e in range(10)]
    kept = [keep_count(d, rate=r) for r in rates]
    by_hand = sum(kept) / (10 * d)  # each epoch has the same number of steps
    assert total_density(kept, [1.0] * 10, numel=d) == pytest.approx(by_hand, rel=1e-15)
    assert by_hand == pytest.approx(1 - sum(rates) / 10, abs=1e-3)  # floor(r d) per epoch
    assert total_density([5, 10], [3.0, 1.0], numel=10) == pytest.approx((15 + 10) / 40)
    assert math.isnan(total_density([], [], numel=10))


def _train(method: MethodConfig, *, epochs: int, final_rate: float = 0.0) -> list[torch.Tensor]:
    """Centralized DP-SGD on digits; the flat model after each epoch."""
    train, test = load_dataset("digits", seed=0)
    model = build_model("digits-cnn", seed=0)
    layout = ParamLayout.from_module(model)
    snapshots = []
    train_centralized(
        model,
        (train.x, train.y),
        (test.x, test.y),
        privacy=PrivacyConfig(noise_multiplier=1.0, target_epsilon=None, max_grad_norm=1.0),
        sparsity=SparsityConfig(schedule="constant", final_rate=final_rate, mask_seed=3),
        train=TrainConfig(epochs=epochs, batch_size=64, lr=0.5, momentum=0.9, seed=1),
        on_epoch=lambda _: snapshots.append(layout.flatten_module(model).clone()),
        method=method,
    )
    return snapshots


def test_frozen_layers_move_by_exactly_zero_even_with_momentum() -> None:
    layout = ParamLayout.from_module(build_model("digits-cnn", seed=0))
    s = frozen_prefix(layout, 1)
    w = _train(MethodConfig(name="lf", freeze_layers=1, freeze_after=2), epochs=4)
    assert not torch.equal(w[0][:s], w[1][:s])  # before t_f the first layer trains
    assert torch.equal(w[1][:s], w[2][:s]) and torch.equal(w[2][:s], w[3][:s])  # then never
    assert not torch.equal(w[2][s:], w[3][s:])  # the other layers keep training


def test_layer_freezing_costs_the_privacy_of_plain_dpsgd() -> None:
    """The freeze is set by hyperparameters, not data: the accountant is unchanged (LF 3.1)."""
    train, _ = load_dataset("digits", seed=0)
    q, steps = sample_rate(len(train), 64), 2 * steps_per_epoch(len(train), 64)
    model = build_model("digits-cnn", seed=0)
    history = train_centralized(
        model,
        (train.x, train.y),
        (train.x[:64], train.y[:64]),
        privacy=PrivacyConfig(noise_multiplier=1.0, target_epsilon=None),
        sparsity=SparsityConfig(),
        train=TrainConfig(epochs=2, batch_size=64, seed=2),
        method=MethodConfig(name="lf", freeze_layers=1, freeze_after=1),
    )
    plain = compute_epsilon(
        noise_multiplier=1.0, sample_rate=q, steps=steps, delta=1e-5, accountant="rdp"
    )
    assert history[-1].epsilon == pytest.approx(plain, rel=1e-9)
    assert history[0].rate == 0.0 and history[1].rate > 0.0


def test_random_freeze_runs_the_cooling_schedule_centrally() -> None:
    layout = ParamLayout.from_module(build_model("digits-cnn", seed=0))
    train, test = load_dataset("digits", seed=0)
    history = train_centralized(
        build_model("digits-cnn", seed=0),
        (train.x, train.y),
        (test.x, test.y),
        privacy=PrivacyConfig(noise_multiplier=1.0, target_epsilon=None),
        sparsity=SparsityConfig(final_rate=0.8, cooling_steps=2),  # schedule left at gradual
        train=TrainConfig(epochs=4, batch_size=64, seed=2),
        method=MethodConfig(name="random-freeze"),
    )
    expected = RateSchedule(kind="cooling", final_rate=0.8, total_steps=4, cooling_steps=2)
    assert [h.rate for h in history] == [expected.rate(e) for e in range(4)]
    assert [h.keep_fraction for h in history] == [
        keep_count(layout.numel, rate=expected.rate(e)) / layout.numel for e in range(4)
    ]


def test_ranked_mask_keeps_the_largest_magnitudes_lower_index_first() -> None:
    scores = torch.tensor([0.5, -3.0, 2.0, -2.0, 0.0, 1.0])
    assert ranked_mask(scores, 3).tolist() == [False, True, True, True, False, False]
    assert ranked_mask(scores, 2).tolist() == [False, True, True, False, False, False]  # tie
    assert not ranked_mask(scores, 0).any() and ranked_mask(scores, 6).all()
    with pytest.raises(ValueError, match="keep=7: expected 0 <= keep <= 6"):
        ranked_mask(scores, 7)


def _mask_counts(method: MethodConfig, epochs: int) -> tuple[torch.Tensor, list[float]]:
    """How often each coordinate is masked in epochs 1..E-1 (r = 0.5), and the epsilons."""
    train, test = load_dataset("digits", seed=0)
    counts = torch.zeros(38_282, dtype=torch.int64)

    def on_mask(epoch: int, mask: torch.Tensor | None) -> None:
        if epoch > 0:
            assert mask is not None and int(mask.sum()) == keep_count(38_282, rate=0.5)
            counts.add_((~mask).to(torch.int64))

    history = train_centralized(
        build_model("digits-cnn", seed=0),
        (train.x, train.y),
        (test.x[:10], test.y[:10]),
        privacy=PrivacyConfig(noise_multiplier=1.0, target_epsilon=None),
        sparsity=SparsityConfig(schedule="constant", final_rate=0.5, mask_seed=1),
        train=TrainConfig(epochs=epochs, batch_size=64, lr=0.5, seed=3),
        method=method,
        on_mask=on_mask,
    )
    return counts, [h.epsilon for h in history]


def test_ranked_and_random_masks_match_figure_12() -> None:
    """RS paper, App. I, Fig. 12: under DP noise the ranking is as random as RS.

    Over E - 1 = 7 epochs at r = 0.5 a random mask drops each coordinate Binomial(7, 1/2)
    times (variance 1.75). Ranking the perturbed gradients gives the same spread; ranking the
    clean (noise-free) gradients freezes the first choice: every coordinate is dropped 0 or
    7 times (variance 12.25).
    """
    epochs, binomial_var = 8, 7 * 0.25
    ranked, eps_ranked = _mask_counts(MethodConfig(name="ranked"), epochs)
    random, eps_random = _mask_counts(MethodConfig(name="rs"), epochs)
    clean, _ = _mask_counts(MethodConfig(name="ranked", clean_ranking=True), epochs)
    for counts in (ranked, random, clean):  # every epoch drops exactly d - keep coordinates
        assert counts.double().mean().item() == pytest.approx(3.5, abs=1e-4)
    # The sample variance over 38,282 coordinates has a standard error of about 0.7 %
    # (sqrt(2 / n) for a near-normal count); 5 % allows for the coordinates' dependence.
    assert ranked.double().var().item() == pytest.approx(binomial_var, rel=0.05)
    assert random.double().var().item() == pytest.approx(binomial_var, rel=0.05)
    assert clean.double().var().item() > 5 * binomial_var
    hist = [torch.bincount(c, minlength=epochs).double() / c.numel() for c in (ranked, random)]
    assert 0.5 * (hist[0] - hist[1]).abs().sum().item() < 0.02  # total variation distance
    # The ranking is post-processing: the same epsilon as random sparsification.
    assert eps_ranked == eps_random


# --- dpssgd -------------------------------------------------------------------------------------


def test_the_public_split_is_disjoint_complete_and_seeded() -> None:
    public, private = public_split(1_437, 0.1, run_seed=3)
    assert len(public) == 144 and len(private) == 1_437 - 144
    assert set(public.tolist()).isdisjoint(private.tolist())
    assert sorted([*public.tolist(), *private.tolist()]) == list(range(1_437))
    again, _ = public_split(1_437, 0.1, run_seed=3)
    other, _ = public_split(1_437, 0.1, run_seed=4)
    assert again.tolist() == public.tolist() and other.tolist() != public.tolist()
    for fraction in (0.0, 1.0, 0.0001):
        with pytest.raises(ValueError, match=f"public-fraction={fraction}"):
            public_split(1_437, fraction, run_seed=3)


def test_layerwise_masks_keep_each_layers_share() -> None:
    layout = _layout("digits-cnn")
    weights = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))
    magnitude = layerwise_mask(weights, layout, rate=0.7, selection="magnitude", seed=1)
    random = layerwise_mask(weights, layout, rate=0.7, selection="random", seed=1)
    for _, start, end in layer_ranges(layout):
        keep = keep_count(end - start, rate=0.7)
        assert int(magnitude[start:end].sum()) == int(random[start:end].sum()) == keep
        kept, dropped = (
            weights[start:end][magnitude[start:end]],
            weights[start:end][~magnitude[start:end]],
        )
        assert kept.abs().min() >= dropped.abs().max()  # the largest |w| of the layer
    assert int(magnitude.sum()) == layerwise_keep(layout, 0.7)
    assert torch.equal(
        random, layerwise_mask(weights, layout, rate=0.7, selection="random", seed=1)
    )
    assert not torch.equal(
        random, layerwise_mask(weights, layout, rate=0.7, selection="random", seed=2)
    )


def test_dpssgd_pretrains_on_public_data_and_freezes_the_unselected() -> None:
    train, test = load_dataset("digits", seed=0)
    model = build_model("digits-cnn", seed=0)
    layout = ParamLayout.from_module(model)
    initial = layout.flatten_module(model).clone()
    seen: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    history = train_centralized(
        model,
        (train.x, train.y),
        (test.x, test.y),
        privacy=PrivacyConfig(noise_multiplier=1.0, target_epsilon=None),
        sparsity=SparsityConfig(final_rate=0.8, mask_seed=2),  # schedule read as constant
        train=TrainConfig(epochs=2, batch_size=64, lr=0.5, momentum=0.5, seed=5, device="cpu"),
        method=MethodConfig(name="dpssgd", public_fraction=0.2, public_epochs=2),
        on_mask=lambda epoch, mask: seen.setdefault(
            epoch, (layout.flatten_module(model).clone(), mask)
        ),
    )
    pretrained, mask = seen[0]
    assert mask is not None and torch.equal(seen[1][1], mask)  # frozen after the selection
    assert not torch.equal(initial, pretrained)  # pretraining moved the model
    expected = layerwise_mask(pretrained, layout, rate=0.8, selection="magnitude", seed=0)
    assert torch.equal(mask, expected)
    final = layout.flatten_module(model)
    assert torch.equal(final[~mask], pretrained[~mask])  # never trained privately: exactly 0
    assert not torch.equal(final[mask], pretrained[mask])
    assert [h.rate for h in history] == [0.8, 0.8]
    # The accountant counts the private examples only (the public ones cost nothing).
    n_private = len(train) - round(0.2 * len(train))
    q, steps = sample_rate(n_private, 64), 2 * steps_per_epoch(n_private, 64)
    plain = compute_epsilon(
        noise_multiplier=1.0, sample_rate=q, steps=steps, delta=1e-5, accountant="rdp"
    )
    assert history[-1].epsilon == pytest.approx(plain, rel=1e-9)


# --- the Method interface and its registry ------------------------------------------------


def test_the_registry_names_every_builtin_method_by_its_own_name() -> None:
    from fedsparse.common.methods import FEDERATED_METHODS, METHOD_CLASSES, METHODS, Method

    assert tuple(METHOD_CLASSES) == METHODS == FEDERATED_METHODS
    for name, cls in METHOD_CLASSES.items():
        assert issubclass(cls, Method) and cls.name == name
        assert type(MethodConfig(name=name).method()) is cls
    # the per-step selectors are exactly GIP's two; only ranked and dpssgd send a support
    assert {n for n, c in METHOD_CLASSES.items() if c.selects_per_step} == {"gip", "random-k"}
    assert {n for n, c in METHOD_CLASSES.items() if c.sends_support} == {"ranked", "dpssgd"}
    assert {n for n, c in METHOD_CLASSES.items() if c.adaptive_support} == {"gip"}


def test_plugin_names_are_checked_without_importing() -> None:
    import sys

    from fedsparse.common.methods import check_method_name, is_plugin

    name = "not_imported_anywhere.sub:Method"
    assert is_plugin(name) and not is_plugin("rs") and not is_plugin("ranked-x")
    check_method_name(name)
    assert MethodConfig(name=name).name == name  # the config holds it; nothing is imported
    assert "not_imported_anywhere" not in sys.modules
    for bad in ("ranked-x", "pkg.mod", "pkg.mod:", ":Cls", "pkg-x.mod:Cls", "pkg.mod:Cls;x"):
        with pytest.raises(ValueError, match=f"method='{bad}': expected one of rs, "):
            check_method_name(bad)
    with pytest.raises(ValueError, match="cannot import 'not_imported_anywhere.sub'"):
        MethodConfig(name=name).method()


def test_the_federated_round_plans_of_the_builtins() -> None:
    layout = _layout("digits-cnn")
    d = layout.numel
    schedule = RateSchedule(kind="constant", final_rate=0.5, total_steps=4)
    weights = torch.randn(d, generator=torch.Generator().manual_seed(0))

    def plan(name: str, server_round: int = 1, frozen: int = 0, **kw: object):
        method = MethodConfig(name=name, **kw).method()  # type: ignore[arg-type]
        return method.plan_round(
            server_round=server_round,
            weights=weights,
            schedule=schedule,
            frozen=frozen,
            layout=layout,
            seed=3,
        )

    rs = plan("rs")
    assert (rs.rate, rs.keep, rs.frozen, rs.support) == (0.5, keep_count(d, rate=0.5), 0, None)
    s = frozen_prefix(layout, 1)
    lf = plan("lf", frozen=s)
    assert (lf.rate, lf.keep, lf.frozen, lf.support) == (s / d, d - s, s, None)
    assert plan("ranked").keep == d  # nothing ranked yet: every coordinate (Alg. 4, line 6)
    selected = plan("dpssgd")
    assert selected.keep == layerwise_keep(layout, 0.5) == selected.support.numel()
    assert plan("gip").support is None and plan("random-k").keep == rs.keep
