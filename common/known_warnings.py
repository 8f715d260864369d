"""The third-party warnings the project silences, each with who raises it and why it is noise.

``quiet_known_warnings()`` ignores exactly these while its block runs and restores the
process's filters after it: nothing is silenced at import time, and a warning not listed here
(a new one, or one of these texts in another category) still shows. A filter matches the start
of the warning's text and its category, as ``warnings.filterwarnings`` does.

To silence another warning, add it here with its reason rather than a filter at the call site.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

__all__ = ["KNOWN_WARNINGS", "KnownWarning", "quiet_known_warnings"]


@dataclass(frozen=True, kw_only=True)
class KnownWarning:
    """A warning to ignore: the start of its text, its category, its source and the reason."""

    message: str  # the text the warning starts with (plain: no regular-expression syntax)
    category: type[Warning]
    source: str
    why: str


KNOWN_WARNINGS: Final[tuple[KnownWarning, ...]] = (
    KnownWarning(
        message="Secure RNG turned off",
        category=UserWarning,
        source="opacus.PrivacyEngine (secure_mode=False)",
        why="the RNG mode is a config field (secure-mode), chosen on purpose; the warning "
        "would repeat on every round of every node",
    ),
    KnownWarning(
        message="Optimal order is the largest alpha",
        category=UserWarning,
        source="opacus.accountants.analysis.rdp.get_privacy_spent",
        why="noise calibration evaluates loose candidate sigmas whose best RDP order is the "
        "largest one; the epsilon is still a valid upper bound (a looser one), and the "
        "accountant's orders are Opacus's defaults, as the recorded results used",
    ),
    KnownWarning(
        message="Full backward hook is firing",
        category=UserWarning,
        source="torch.utils.hooks (Opacus's per-sample hooks)",
        why="the first layer's input (the data) needs no gradient; Opacus's hooks still see "
        "the layer's output gradient, so the per-sample gradients are complete",
    ),
    KnownWarning(
        message="Specifying null_placement",
        category=FutureWarning,
        source="pyarrow >= 25, through datasets' Dataset.sort (flwr-datasets' ShardPartitioner)",
        why="a deprecation inside datasets' own call to pyarrow; our sort has no nulls",
    ),
)


@contextlib.contextmanager
def quiet_known_warnings() -> Iterator[None]:
    """Ignores ``KNOWN_WARNINGS`` inside the block; the warning filters are restored after."""
    with warnings.catch_warnings():
        for known in KNOWN_WARNINGS:
            warnings.filterwarnings("ignore", known.message, known.category)
        yield
