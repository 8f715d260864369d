"""The backends by what they run (``lab/launch/backends.py``): traits, flags, and the sweep
settings that ask them."""

from __future__ import annotations

import pytest

from fedsparse.lab.experiments.sweep_backends import RunSettings
from fedsparse.lab.launch.backends import (
    BACKEND_TRAITS,
    BACKENDS,
    DEFAULT_BACKEND,
    backend_args,
    traits,
)


def test_every_backend_has_traits_and_a_flag() -> None:
    assert tuple(BACKEND_TRAITS) == BACKENDS
    assert backend_args(DEFAULT_BACKEND) == [] and backend_args("simulation") == []
    assert backend_args("ray") == ["--backend", "ray"]
    assert traits("simulation") == traits("flower")
    with pytest.raises(ValueError, match="backend='grid': expected one of flower"):
        traits("grid")


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_sweep_settings_follow_the_traits(backend: str) -> None:
    found = traits(backend)
    for accepted, kwargs in (
        (found.shaped_links, {"uplink_bps": 1e6}),
        (found.cluster, {"ray_address": "127.0.0.1:6379"}),
        (found.gpus, {"gpus_per_client": 0.5}),
    ):
        if accepted:
            RunSettings(backend=backend, **kwargs)  # type: ignore[arg-type]
        else:
            with pytest.raises(ValueError, match=f"backend={backend!r}"):
                RunSettings(backend=backend, **kwargs)  # type: ignore[arg-type]
