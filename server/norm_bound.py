"""The norm bound at the server: ``dp-norm-bound``'s caps and the bound each round holds
updates to.

``train_split_size`` is the most examples an honest client can hold when no
``max-client-examples`` caps it (the training split's size, loaded once per process);
``derived_bound`` is a round's bound from an honest client's public DP parameters
(``common/aggregation/norm_bounds.py: HonestClientBound``); ``bound_norms`` holds the round's
valid updates to the smallest of it, ``max-update-norm`` and ``max-norm-ratio`` x the median
norm, rejecting or clipping each update above it (``norm-action``); ``fixed_bound`` is the
round's bound when it is set before the round (no ``max-norm-ratio``), which
``round_updates.aggregate_bounded`` holds a stream of updates to.
"""

from __future__ import annotations

import functools

from fedsparse.common.aggregation.norm_bounds import HonestClientBound, NormAction, NormBound
from fedsparse.common.config import FederatedConfig
from fedsparse.common.data.datasets import load_eval_splits
from fedsparse.server.round_stats import RoundStats
from fedsparse.server.round_updates import Candidate, bound_each

__all__ = ["bound_norms", "derived_bound", "fixed_bound", "train_split_size"]


def derived_bound(
    caps: HonestClientBound, *, keep: int, d: int, selects_per_step: bool
) -> tuple[float, str]:
    """A round's ``dp-norm-bound`` and its description, for noise covering ``keep``
    coordinates a step (``selects_per_step``: each reply carries the union of its steps'
    supports)."""
    # gip, random-k: the payload holds the union of the steps' supports, up to d values
    bound = caps.bound(keep, sent=d if selects_per_step else None)
    smallest = caps.smallest_covered_examples(keep, sent=d if selects_per_step else None)
    how = (
        f"dp-norm-bound={bound:.4g}: sigma<={caps.noise_multiplier:.4g}, <={caps.max_steps} "
        f"steps, keep {keep}, clients of >={smallest} of <={caps.max_examples} examples"
    )
    if smallest > 1 and not caps.min_examples:  # where a small honest client's reply goes
        how += "; fewer: set min-client-examples"
    if caps.feedback_keep:  # the residual of every earlier round's rounding included
        how += f"; error feedback, rounds of <={caps.feedback_keep} values"
    return bound, how


def bound_norms(
    stats: RoundStats,
    candidates: list[Candidate],
    *,
    norm_bound: NormBound,
    derived: tuple[float, str] | None,
    norm_action: NormAction,
) -> list[Candidate]:
    """The candidates within the round's norm bound; the others rejected or clipped.

    The bound is the smallest of ``norm_bound``'s over the candidates' norms and ``derived``
    (``derived_bound``); ``norm_action`` says what happens to an update above it.
    """
    bound, how = norm_bound.bound([c.norm for c in candidates], honest=derived)
    return list(bound_each(stats, candidates, bound=bound, how=how, norm_action=norm_action))


def fixed_bound(
    norm_bound: NormBound, derived: tuple[float, str] | None
) -> tuple[float, str] | None:
    """The round's bound and its description when no rule reads the round's own norms
    (``max-norm-ratio=0``); None when one does (the round's updates are then held until
    their median is known)."""
    if norm_bound.max_norm_ratio > 0:
        return None
    return norm_bound.bound([], honest=derived)


@functools.lru_cache(maxsize=8)
def _split_size(dataset: str, data_dir: str, seed: int, eval_split: str, split_seed: int) -> int:
    train, _ = load_eval_splits(
        dataset,  # type: ignore[arg-type]
        data_dir=data_dir or None,
        seed=seed,
        eval_split=eval_split,  # type: ignore[arg-type]
        split_seed=split_seed,
    )
    return len(train)


def train_split_size(cfg: FederatedConfig) -> int:
    """The size of the whole training split (a validation slice held out or not: a deployed
    node may declare all of it).

    Raises:
        ValueError: it does not load; the message names the keys that replace it.
    """
    try:
        return _split_size(cfg.dataset, cfg.data_dir, cfg.seed, "test", cfg.data_seed)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"dp-norm-bound='auto' needs the most examples a client holds: dataset="
            f"{cfg.dataset!r} data-dir={cfg.data_dir!r} did not load ({err}); set "
            "max-client-examples, or dp-norm-bound='off'"
        ) from err
