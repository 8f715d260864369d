"""DP-SGD with sparsification: the optimizer and engine (``optimizer``), the per-sample
engines (``engines/``), accounting (``accounting``), user-level DP (``central``) and the
clip/momentum scaling rule (``scaling``).

The package re-exports ``optimizer``'s names, its import name before the engines had a home.
"""

from fedsparse.common.dp.optimizer import (
    MECHANISMS,
    MechanismName,
    PerSampleCriterion,
    PerSampleLoss,
    PerSampleModule,
    SparseDPEngine,
    SparseDPOptimizer,
    check_own_wrapping,
    flush_denormals,
    os_entropy_generator,
    zero_non_finite,
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
