"""One client's local round: DP-SGD + RS from the global model, and the update it sends.

``train_round`` loads the round's global weights into the process's model, builds the round's
mask (the public seeded mask of ``mask-scope=round``, or from the seed and the node id under
``mask-scope=client``; lf's unfrozen suffix; the server's explicit support under ranked and
dpssgd; none under gip and random-k, whose every step chooses its own support), runs
``local-epochs`` of DP-SGD with the node's accountant history, and encodes the delta on the
kept coordinates as a ``TrainReply`` (``selected_payload``: the union of the steps' supports,
sent explicitly). With ``error-feedback`` the values sent carry the node's residual
(``feed_back``). ``client/app.py`` decides everything before it: the request's checks, the
node's budget and the ledger's charge.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from flwr.app import Context
from torch import nn

from fedsparse.client.model_cache import release
from fedsparse.client.node_policy import NodePolicy
from fedsparse.common import masks
from fedsparse.common.config import FederatedConfig, wire_encoding
from fedsparse.common.data.datasets import Split
from fedsparse.common.dp.accounting import accountant_epsilon
from fedsparse.common.layout import ParamLayout
from fedsparse.common.methods import suffix_mask
from fedsparse.common.methods.index_selection import StepSelector
from fedsparse.common.seeds import client_train_seed, value_rounding
from fedsparse.common.training.configs import PrivacyConfig, TrainConfig
from fedsparse.common.training.local import (
    make_private,
    padded_cross_entropy,
    train_one_epoch,
)
from fedsparse.common.wire.payload import IndexEncoding, decode_update, encode_update
from fedsparse.common.wire.protocol import TrainInstruction, TrainReply, client_mask_seed

__all__ = ["feed_back", "selected_payload", "train_round"]


def train_round(
    cfg: FederatedConfig,
    task: TrainInstruction,
    policy: NodePolicy,
    privacy: PrivacyConfig,
    context: Context,
    data: Split,
    global_flat: torch.Tensor,
    history: list[tuple[float, float, int]],
    frozen: int = 0,
    explicit: torch.Tensor | None = None,
    *,
    model: nn.Module,
    selector: StepSelector | None = None,
    index_spent: float = 0.0,
    partition_id: int = 0,
    residual: torch.Tensor | None = None,
    nominal_size: int | None = None,
) -> tuple[TrainReply, list[tuple[float, float, int]]]:
    """Local DP-SGD + RS from ``global_flat``; (the reply, the run's accountant history).

    With ``frozen`` > 0 (lf) the mask keeps ``[frozen, d)`` and the reply carries those
    values only, as a dense vector of ``d - frozen`` values; with an ``explicit`` support
    (ranked, dpssgd) the mask is that support and the reply its values, in support order.
    ``model`` is the run's architecture (the process's, ``client/model_cache.py:
    process_model``); its weights are replaced, and Opacus's hooks and the gradients are
    taken off it again before returning.
    With a ``selector`` (gip, random-k) every DP step chooses its support and the
    reply carries the union of those supports explicitly (``index_spent``: GIP's index
    epsilon of earlier rounds, for the reported epsilon).
    With a ``residual`` (``error-feedback``: a float32 vector of length d) the reply sends
    the quantized ``values + residual`` on the round's support, and ``residual`` is updated in
    place on that support (``feed_back``).
    With a ``nominal_size`` (the node's declared ``nominal-size``) the data is padded to it
    with dummy rows whose gradients are 0 (``make_private``): the Poisson rate, the steps, the
    noise's scale and every batch's size are that size's, never ``len(data)``'s.
    """
    layout = ParamLayout.from_module(model)
    numel = layout.numel
    layout.load_flat_(model, global_flat)
    # The round's public mask: from the broadcast seed (and node id for per-client masks).
    mask_seed = task.mask_seed
    if task.mask_scope == "client":
        mask_seed = client_mask_seed(mask_seed, context.node_id)
    if selector is not None:  # gip, random-k: no public mask, each step chooses
        mask = None
    elif frozen:
        mask = suffix_mask(numel, frozen)
    elif explicit is not None:
        mask = torch.zeros(numel, dtype=torch.bool)
        mask[explicit] = True
    else:  # the process's shared mask, copied: the DP engine holds its own for the round
        mask = (
            None if task.keep == numel else masks.seeded_mask(numel, task.keep, mask_seed).clone()
        )
    seeded = policy.noise == "seeded"
    train_cfg = TrainConfig(
        epochs=task.local_epochs,
        batch_size=task.batch_size,
        lr=task.lr,
        momentum=task.momentum,
        engine=cfg.engine,
        device=cfg.device,
        # Seeded streams only when the node asks (simulation); else fresh OS entropy.
        seed=client_train_seed(cfg.seed, task.server_round, partition_id) if seeded else None,
    )
    module = None
    try:
        engine, module, optimizer, loader = make_private(
            model,
            data.x,
            data.y,
            privacy=privacy,
            train=train_cfg,
            epochs_for_target=1,
            nominal_size=nominal_size,
        )
        engine.accountant.history = list(history)
        engine.set_mask(mask)
        if selector is not None:
            engine.set_step_selector(selector)
        losses, examples = [], 0
        criterion = padded_cross_entropy if nominal_size is not None else None
        for _ in range(train_cfg.epochs):
            loss, n = train_one_epoch(module, optimizer, loader, criterion=criterion)
            losses.append(loss)
            examples += n
    finally:
        release(model, module)
    # engine.get_epsilon's value, from the memoized accountant (ε of the whole history).
    epsilon = (
        accountant_epsilon(
            engine.accountant.history, delta=privacy.delta, accountant=privacy.accountant
        )
        + index_spent
        + engine.index_epsilon
        if privacy.mechanism == "dpsgd"
        else math.inf
    )

    delta = layout.flatten_module(model).cpu() - global_flat  # the model trained on cfg.device
    # int4/int2/int1's rounding: seeded exactly when the DP noise is (simulation), else OS
    # entropy, so that the server cannot predict it (other dtypes never draw from it)
    rounding = value_rounding(
        cfg.seed, task.server_round, partition_id, seeded=seeded and not privacy.secure_mode
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
            mask_seed=mask_seed if seeded_mask else None,
            encoding=wire_encoding(cfg.codec, sparse=seeded_mask),
            value_dtype=cfg.value_dtype,
            value_block=cfg.value_block,
            rounding=rounding,
            compression=cfg.compression,
        )
    if residual is not None:
        feed_back(residual, support, values, payload, server_round=task.server_round)
    counts = policy.release_example_count
    reply = TrainReply(
        update=payload,
        # Not released by default: 1 and 0 (the server weights updates uniformly).
        num_examples=len(data) if counts else 1,
        examples_seen=examples if counts else 0,
        train_loss=(float(np.nanmean(losses)) if examples else 0.0)
        if policy.release_train_loss and not cfg.secure_aggregation  # nothing in the clear
        else math.nan,
        epsilon=float(epsilon),
        noise_multiplier=float(privacy.noise_multiplier or 0.0),
        keep=int(values.numel()),
        seeded_noise=int(seeded and not privacy.secure_mode),
    )
    return reply, list(engine.accountant.history)


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
    rounding: np.random.Generator,
) -> tuple[bytes, torch.Tensor]:
    """gip / random-k: (the payload, its values): ``delta`` on the union of the
    steps' supports, with that support explicit (``codec``; ``values``/``auto``: the
    smallest of coo, delta and bitmap), or dense when every coordinate was chosen.

    Raises:
        RuntimeError: ``delta`` moved a coordinate off the union (a bug: no step chose it).
    """
    if bool(delta[~union].any()):
        raise RuntimeError("gip: the update moved coordinates no step selected")
    if bool(union.all()):
        encoding: IndexEncoding = "dense"
    else:
        encoding = "auto" if cfg.codec in ("values", "auto") else cfg.codec  # type: ignore[assignment]
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
