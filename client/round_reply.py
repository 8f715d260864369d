"""A client's round, encoded: ``round_reply`` (the update on the round's support, in the run's
codec, with error feedback, and the reported numbers), ``feed_back`` and ``selected_payload``.

``client_round`` (``client/local_round.py``) and the population runner (``client/population.py``)
end their rounds here, so the two send the same kind of bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedsparse.common.config import FederatedConfig
from fedsparse.common.dp.accounting import accountant_epsilon
from fedsparse.common.dp.mechanisms import is_private
from fedsparse.common.methods.index_selection import StepSelector
from fedsparse.common.wire.payload import IndexEncoding, decode_update, encode_update
from fedsparse.common.wire.protocol import TrainInstruction, TrainReply
from fedsparse.common.wire.value_formats import explicit_encoding, value_format, wire_encoding

if TYPE_CHECKING:
    from fedsparse.client.local_round import (
        LocalTraining,
        PublicRound,
        Release,
        RoundNoise,
        RoundPrivacy,
    )

__all__ = ["feed_back", "round_reply", "selected_payload"]


def round_reply(
    global_flat: torch.Tensor,
    num_examples: int,
    public: PublicRound,
    round_privacy: RoundPrivacy,
    noise: RoundNoise,
    local: LocalTraining,
    mask: torch.Tensor | None,
    selector: StepSelector | None,
    release: Release,
    residual: torch.Tensor | None,
) -> TrainReply:
    """The round's reply from its local training: the delta on the round's support, encoded
    by the run's codec (with the ``residual`` fed back, updated in place), and the reported
    numbers (ε of the whole history, what ``release`` allows)."""
    cfg, task, frozen, explicit = public.cfg, public.task, public.frozen, public.explicit
    privacy = round_privacy.privacy
    numel = int(global_flat.numel())
    # engine.get_epsilon's value, from the memoized accountant (ε of the whole history).
    epsilon = (
        accountant_epsilon(local.history, delta=privacy.delta, accountant=privacy.accountant)
        + round_privacy.index_spent
        + local.index_epsilon
        if is_private(privacy.mechanism)
        else math.inf
    )
    delta = local.trained - global_flat
    # int4/int2/int1's rounding: seeded exactly when the DP noise is (simulation), else OS
    # entropy, so that the server cannot predict it (other dtypes never draw from it)
    # (drawn only for them: a generator costs ~50 µs a client)
    rounding = (
        noise.rounding(task.server_round, secure_mode=privacy.secure_mode)
        if value_format(cfg.value_dtype).lowbit
        else None
    )
    support = selector.union if selector is not None else mask  # None: every coordinate
    if residual is not None:  # what the rounding lost in earlier rounds, sent this round
        delta = delta.clone()
        if support is None:
            delta += residual
        else:
            delta[support] += residual[support]
    if selector is not None:  # the union of the steps' supports travels explicitly
        payload, values = selected_payload(cfg, task, delta, selector.union, rounding)
    else:
        values = delta if mask is None else delta[mask]
        if cfg.secure_aggregation:  # never fail on the node's own values: zero them all
            values = torch.where(torch.isfinite(values).all(), values, torch.zeros_like(values))
        seeded_mask = mask is not None and not frozen and explicit is None
        payload = encode_update(
            values,
            dense_size=numel - frozen if explicit is None else int(explicit.numel()),
            round=task.server_round,
            mask_seed=public.mask_seed if seeded_mask else None,
            encoding=wire_encoding(cfg.codec, sparse=seeded_mask),
            value_dtype=cfg.value_dtype,
            value_block=cfg.value_block,
            rounding=rounding,
            compression=cfg.compression,
        )
    if residual is not None:
        feed_back(residual, support, values, payload, server_round=task.server_round)
    counts = release.example_count
    examples, losses = local.examples, local.epoch_losses
    return TrainReply(
        update=payload,
        # Not released by default: 1 and 0 (the server weights updates uniformly).
        num_examples=num_examples if counts else 1,
        examples_seen=examples if counts else 0,
        train_loss=(_nanmean(losses) if examples else 0.0)
        if release.train_loss and not cfg.secure_aggregation  # nothing in the clear
        else math.nan,
        epsilon=float(epsilon),
        noise_multiplier=float(privacy.noise_multiplier or 0.0),
        keep=int(values.numel()),
        seeded_noise=int(noise.seeded and not privacy.secure_mode),
    )


def feed_back(
    residual: torch.Tensor,
    support: torch.Tensor | None,
    values: torch.Tensor,
    payload: bytes,
    *,
    server_round: int,
) -> None:
    """Error feedback: ``residual[support] = values - decode(payload)``, in place.

    ``values`` are the round's values on ``support`` (a boolean mask; None: every
    coordinate), in the order the payload carries them, residual included; ``payload`` their
    encoding. The decoded values are what the server decodes from the same bytes
    (``decode_update``), so the residual is exactly the error the server's copy carries.
    Coordinates off the support keep their residual.

    Privacy: post-processing. The residual is a function of the values the DP mechanism
    already released (the noised update, each round accounted) and of the rounding's own
    randomness, never of the data otherwise; feeding it back costs no privacy.
    """
    decoded = decode_update(
        payload, expected_round=server_round, expected_keep=int(values.numel())
    ).values
    error = values - decoded.to(values.dtype)
    if support is None:
        residual.copy_(error)
    else:
        residual[support] = error


def selected_payload(
    cfg: FederatedConfig,
    task: TrainInstruction,
    delta: torch.Tensor,
    union: torch.Tensor,
    rounding: np.random.Generator | None,
) -> tuple[bytes, torch.Tensor]:
    """gip / random-k: (the payload, its values): ``delta`` on the union of the
    steps' supports, with that support explicit (``codec``; ``values``/``auto``: the
    smallest of coo, delta and bitmap), or dense when every coordinate was chosen.

    Raises:
        RuntimeError: ``delta`` moved a coordinate off the union (a bug: no step chose it).
    """
    if bool(delta[~union].any()):
        raise RuntimeError("gip: the update moved coordinates no step selected")
    encoding: IndexEncoding = "dense" if bool(union.all()) else explicit_encoding(cfg.codec)
    index = torch.nonzero(union).flatten()
    values = delta[index]
    payload = encode_update(
        values,
        dense_size=int(delta.numel()),
        round=task.server_round,
        indices=None if encoding == "dense" else index,
        encoding=encoding,
        value_dtype=cfg.value_dtype,
        value_block=cfg.value_block,
        rounding=rounding,
        compression=cfg.compression,
    )
    return payload, values


def _nanmean(losses: Sequence[float]) -> float:
    """``float(np.nanmean(losses))``, bit for bit: below 8 Python floats numpy adds them one
    by one (from 8 on it sums pairwise, other types in their own precision: numpy then runs),
    and the call costs 0.1 ms a client."""
    if len(losses) >= 8 or not all(type(x) is float for x in losses):  # numpy's own
        return float(np.nanmean(losses))
    kept = [float(x) for x in losses if not math.isnan(x)]
    if not kept:
        return math.nan
    total = 0.0
    for x in kept:
        total += x
    return total / len(kept)
