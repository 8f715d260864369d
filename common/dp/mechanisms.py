"""The training mechanisms by what they do: the one place their names are compared.

``dpsgd`` clips each example's gradient and adds Gaussian noise (DP-SGD: the only one with a
privacy guarantee, so the only one an accountant charges); ``clipped`` clips and adds no noise
and ``noisy`` adds noise to unclipped gradients (the RS paper's ablations, Algorithms 3 and
2). Everything outside ``common/dp/`` asks a ``Mechanism`` (``mechanism_of("dpsgd").private``)
instead of comparing its name (``tests/test_layout.py`` keeps it so).
"""

from __future__ import annotations

import dataclasses
from typing import Final

from fedsparse.common.names import MECHANISMS, MechanismName

__all__ = ["MECHANISM_REGISTRY", "Mechanism", "clips_per_sample", "is_private", "mechanism_of"]


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """A training mechanism.

    Attributes:
        name: its run-config name (``mechanism=``).
        clips: each example's gradient is clipped to ``max-grad-norm``.
        noises: Gaussian noise of ``noise-multiplier`` is added to the summed gradient.
    """

    name: MechanismName
    clips: bool
    noises: bool

    @property
    def private(self) -> bool:
        """Differentially private (clipped and noised): accounted, calibrated, charged."""
        return self.clips and self.noises


MECHANISM_REGISTRY: Final[dict[str, Mechanism]] = {
    "dpsgd": Mechanism("dpsgd", clips=True, noises=True),
    "clipped": Mechanism("clipped", clips=True, noises=False),
    "noisy": Mechanism("noisy", clips=False, noises=True),
}
assert tuple(MECHANISM_REGISTRY) == MECHANISMS


def mechanism_of(name: str) -> Mechanism:
    """The mechanism named ``name``.

    Raises:
        ValueError: an unknown name, naming it and the known ones.
    """
    try:
        return MECHANISM_REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"mechanism={name!r}: expected one of {', '.join(MECHANISM_REGISTRY)}"
        ) from None


def is_private(name: str) -> bool:
    """Whether ``name`` is a private mechanism of the registry (False for the ablations and
    for names outside it, such as a node's ``secagg`` release, which has its own rule)."""
    found = MECHANISM_REGISTRY.get(name)
    return found is not None and found.private


def clips_per_sample(name: str) -> bool:
    """Whether ``name`` is a mechanism of the registry that clips each example's gradient."""
    found = MECHANISM_REGISTRY.get(name)
    return found is not None and found.clips
