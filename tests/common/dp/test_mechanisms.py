"""The mechanisms by what they do (``common/dp/mechanisms.py``): the registry's traits are the
engine's behaviour."""

from __future__ import annotations

import pytest
import torch

from fedsparse.common.dp.mechanisms import MECHANISM_REGISTRY, is_private, mechanism_of
from fedsparse.common.names import MECHANISMS
from fedsparse.common.training.configs import PrivacyConfig, TrainConfig
from fedsparse.common.training.local import make_private


def test_the_registry_names_every_mechanism_and_only_dpsgd_is_private() -> None:
    assert tuple(MECHANISM_REGISTRY) == MECHANISMS
    assert [m for m in MECHANISMS if is_private(m)] == ["dpsgd"]
    assert not is_private("secagg")  # a node's release, outside the registry: its own rule
    with pytest.raises(ValueError, match="mechanism='sgd': expected one of dpsgd, clipped"):
        mechanism_of("sgd")


def _private(name: str, sigma: float):
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2))
    x, y = torch.randn(8, 1, 2, 2), torch.randint(0, 2, (8,))
    privacy = PrivacyConfig(
        mechanism=name,  # type: ignore[arg-type]
        noise_multiplier=sigma,
        target_epsilon=None,
        max_grad_norm=1.0,
    )
    train = TrainConfig(epochs=1, batch_size=4, lr=0.1, seed=0, engine="opacus")
    return make_private(model, x, y, privacy=privacy, train=train, epochs_for_target=1)


@pytest.mark.parametrize("name", MECHANISMS)
def test_the_engine_does_what_the_registry_says(name: str) -> None:
    """Clipping per sample, refusing noise where it adds none, epsilon only where private."""
    found = mechanism_of(name)
    sigma = 1.0 if found.noises else 0.0
    engine, _, optimizer, _ = _private(name, sigma)
    assert optimizer.clip_per_sample == found.clips
    assert (engine.get_epsilon(1e-5) == float("inf")) == (not found.private)
    if not found.noises:
        with pytest.raises(ValueError, match="adds no noise"):
            _private(name, 1.0)
