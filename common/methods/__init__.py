"""Which coordinates train in each epoch (centralized) or round (federated): the ``method``.

One class per method (``base.Method``: its server side, its client side, its config checks
and its accounting hook together), one module each, and a registry of the built-in names
(``registry.METHOD_CLASSES``); ``method=package.module:Class`` names a user's subclass.

=================  ==========================================================================
``rs``             ``rs.py``: random sparsification ("Differentially Private Federated
                   Learning with Random Sparsification", arXiv:2112.00845, Algorithm 1)
``random-freeze``  ``rs.py``: the same paper's earlier random freeze (the cooling schedule)
``lf``             ``lf.py``: DPSGD-LF, layer freezing
``ranked``         ``ranked.py``: ranked sparsification (arXiv:2112.00845, Algorithm 4)
``dpssgd``         ``dpssgd.py``: DP-SSGD, public-data pruning (arXiv:2303.04612)
``gip``            ``gip.py``: GIP's noisy top-k index pruning, per DP step
``random-k``       ``gip.py``: GIP's random-k baseline
=================  ==========================================================================

Every method but ``gip`` chooses its coordinates from public information only (the config,
the model's layout, the step, a public seed, the public global model), never from data, so
the privacy accounting of DP-SGD is unchanged (the mask is applied before per-sample clipping
and the noise is added on the kept coordinates only: ``common/dp/optimizer.py``). GIP pays for its
data-dependent choice from its own share of the budget (``Method.split_privacy``).

The total density of a run (non-zero gradient coordinates over the dense count, over the
whole run: random freeze's measure) is reported for every method (``total_density``).

Steps are 0-based: epoch ``e`` in ``0..E-1``, or round ``r - 1``.
"""

from fedsparse.common.methods.base import EpochContext, Method, RoundPlan
from fedsparse.common.methods.config import (
    FEDERATED_METHODS,
    METHODS,
    SELECTION_MODES,
    FederatedMethodName,
    MethodConfig,
    MethodName,
    SelectionMode,
    method_schedule,
)
from fedsparse.common.methods.registry import (
    METHOD_CLASSES,
    check_method_name,
    is_plugin,
    method_class,
)
from fedsparse.common.methods.selection import (
    SELECTIONS,
    SelectionName,
    federated_ranking_scores,
    frozen_prefix,
    layer_ranges,
    layerwise_keep,
    layerwise_mask,
    public_split,
    ranked_mask,
    suffix_mask,
    total_density,
)

__all__ = [
    "FEDERATED_METHODS",
    "METHODS",
    "METHOD_CLASSES",
    "SELECTIONS",
    "SELECTION_MODES",
    "EpochContext",
    "FederatedMethodName",
    "Method",
    "MethodConfig",
    "MethodName",
    "RoundPlan",
    "SelectionMode",
    "SelectionName",
    "check_method_name",
    "federated_ranking_scores",
    "frozen_prefix",
    "is_plugin",
    "layer_ranges",
    "layerwise_keep",
    "layerwise_mask",
    "method_class",
    "method_schedule",
    "public_split",
    "ranked_mask",
    "suffix_mask",
    "total_density",
]
