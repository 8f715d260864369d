"""DP-SGD with sparsification: the optimizer (``optimizer``), the privacy engine (``engine``),
the modules that compute their own per-sample gradients (``per_sample``), the per-sample
engines (``engines/``), accounting (``accounting``), user-level DP (``central``) and the
clip/momentum scaling rule (``scaling``).

The package re-exports the names of ``optimizer``, ``engine`` and ``per_sample``.
"""

from fedsparse.common.dp.engine import SparseDPEngine, flush_denormals, os_entropy_generator
from fedsparse.common.dp.optimizer import (
    MECHANISMS,
    MechanismName,
    SparseDPOptimizer,
    zero_non_finite,
)
from fedsparse.common.dp.per_sample import (
    PerSampleCriterion,
    PerSampleLoss,
    PerSampleModule,
    check_own_wrapping,
)

__all__ = [
    "MECHANISMS",
    "MechanismName",
    "PerSampleCriterion",
    "PerSampleLoss",
    "PerSampleModule",
    "SparseDPEngine",
    "SparseDPOptimizer",
    "check_own_wrapping",
    "flush_denormals",
    "os_entropy_generator",
    "zero_non_finite",
]
