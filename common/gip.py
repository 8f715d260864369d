"""GIP's per-step index selection, under its earlier import name.

The mechanism lives with the methods that use it (``fedsparse.common.methods.index_selection``;
the ``gip`` and ``random-k`` methods: ``fedsparse.common.methods.gip``); this module keeps
``fedsparse.common.gip`` importable with every name it exported.
"""

from fedsparse.common.methods.index_selection import (
    DEFAULT_INDEX_FRACTION,
    INDEX_METHODS,
    IndexBudget,
    IndexMethod,
    StepSelector,
    group_sizes,
    split_budget,
)

__all__ = [
    "DEFAULT_INDEX_FRACTION",
    "INDEX_METHODS",
    "IndexBudget",
    "IndexMethod",
    "StepSelector",
    "group_sizes",
    "split_budget",
]
