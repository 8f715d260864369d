"""A client's round as one function: ``client_round``, with no Flower type in or out.

``client_round(global weights, the node's examples, the round's public instruction, privacy
parameters, a noise source) -> RoundResult``: the update and the reported numbers (a
``TrainReply``), with the node's accountant history, index ε and error-feedback residual after
the round. The privacy parameters have no defaults: a runner that leaves out the node's history,
its index ε or its nominal size would under-report ε or leak its count. It loads the round's global
weights into the process's model, builds the round's mask (the public seeded mask of
``mask-scope=round``, or from the seed and the node id under ``mask-scope=client``; lf's
unfrozen suffix; the server's explicit support under ranked and dpssgd; none under gip and
random-k, whose every step chooses its own support), runs ``local-epochs`` of DP-SGD with the
node's accountant history, and encodes the delta on the kept coordinates as a ``TrainReply``
(``selected_payload``: the union of the steps' supports, sent explicitly). With
``error-feedback`` the values sent carry the node's residual (``feed_back``).

Everything before it is the caller's: the request's checks, the node's policy and budget, σ's
calibration and the ledger's charge (``client/app.py``, the ClientApp every runner sends its
messages to: Flower's simulation engine, ``RayGrid``'s workers, ``InProcessGrid`` and a
deployed SuperNode). A runner that simulates a population without messages calls this
function with the same arguments and gets the same bytes (``tests/client/test_client_round.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from fedsparse.client.model_cache import release as release_model
from fedsparse.common import masks
from fedsparse.common.config import FederatedConfig
from fedsparse.common.data.datasets import Split
from fedsparse.common.dp.accounting import accountant_epsilon
from fedsparse.common.dp.mechanisms import is_private
from fedsparse.common.layout import ParamLayout
from fedsparse.common.methods import suffix_mask
from fedsparse.common.methods.base import Method
from fedsparse.common.methods.index_selection import IndexBudget, StepSelector
from fedsparse.common.seeds import Stream, client_train_seed, stream_seed, value_rounding
from fedsparse.common.training.configs import PrivacyConfig, TrainConfig
from fedsparse.common.training.local import (
    make_private,
    padded_cross_entropy,
    train_one_epoch,
)
from fedsparse.common.wire.payload import IndexEncoding, decode_update, encode_update
from fedsparse.common.wire.protocol import TrainInstruction, TrainReply, client_mask_seed
from fedsparse.common.wire.value_formats import explicit_encoding, wire_encoding

__all__ = [
    "RoundNoise",
    "PublicRound",
    "Release",
    "RoundPrivacy",
    "RoundResult",
    "client_round",
    "feed_back",
    "selected_payload",
]

History = list[tuple[float, float, int]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublicRound:
    """The round's public instruction, as the node resolved it: nothing here is private.

    Attributes:
        cfg: the run config.
        task: the server's train instruction (checked against ``cfg`` by the caller).
        method: the run's method, one instance for the round.
        node_id: the node's id (``mask-scope=client`` derives its mask from it).
        frozen: lf's frozen coordinate prefix this round (0: none).
        explicit: the server's support (ranked, dpssgd; None: the seeded mask or every
            coordinate).
    """

    cfg: FederatedConfig
    task: TrainInstruction
    method: Method
    node_id: int
    frozen: int = 0
    explicit: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoundPrivacy:
    """The round's privacy parameters, decided before any private value is read.

    Attributes:
        privacy: the mechanism with its σ (calibrated: ``target_epsilon`` None).
        history: the node's accountant history before the round, (σ, q, steps) entries.
        index_spent: gip's index ε of earlier rounds (for the reported ε).
        keep_fraction: per-step methods' keep ratio this round (``Method.index_charge``).
        budget: gip's index budget (``Method.split_privacy``; None: none).
        nominal_size: the node's declared ``nominal-size`` (None: its real count); the
            examples are padded to it (``make_private``), so the rate, the steps, the noise's
            scale and every batch's size are its, never the real count's.
    """

    privacy: PrivacyConfig
    history: Sequence[tuple[float, float, int]]
    index_spent: float
    nominal_size: int | None
    keep_fraction: float = 1.0
    budget: IndexBudget | None = None


@dataclasses.dataclass(frozen=True)
class RoundNoise:
    """Where the round's randomness comes from.

    ``seeded`` (a simulated node): Poisson sampling, DP noise, per-step index selection and
    value rounding all come from streams of ``client_train_seed(run_seed, round,
    partition_id)``, so a simulation reproduces bit for bit. Otherwise (a deployed node) from
    OS entropy: nothing the server sends lets it predict the node's noise.
    """

    seeded: bool
    run_seed: int = 0
    partition_id: int = 0

    @classmethod
    def fresh(cls) -> RoundNoise:
        """OS entropy for every draw."""
        return cls(seeded=False)

    def train_seed(self, server_round: int) -> int | None:
        """The base seed of the round's DP-SGD (None: fresh)."""
        if not self.seeded:
            return None
        return client_train_seed(self.run_seed, server_round, self.partition_id)

    def index_seed(self, server_round: int, *, secure_mode: bool) -> int | None:
        """The seed of per-step index selection (None: fresh; always under secure mode)."""
        if not self.seeded or secure_mode:
            return None
        return stream_seed(
            client_train_seed(self.run_seed, server_round, self.partition_id),
            Stream.INDEX_SELECTION,
        )

    def rounding(self, server_round: int, *, secure_mode: bool) -> np.random.Generator:
        """The generator of the round's stochastic value rounding (``value_rounding``)."""
        return value_rounding(
            self.run_seed,
            server_round,
            self.partition_id,
            seeded=self.seeded and not secure_mode,
        )


@dataclasses.dataclass(frozen=True)
class Release:
    """What the node reports in the clear beside its noised update (its policy's
    ``release-example-count`` and ``release-train-loss``; by default neither)."""

    example_count: bool = False
    train_loss: bool = False


@dataclasses.dataclass(frozen=True)
class RoundResult:
    """What a round returns.

    Attributes:
        reply: the update and the reported numbers.
        history: the node's accountant history after the round.
        index_spent: gip's index ε after the round (earlier rounds' plus this one's).
        residual: the error-feedback residual after the round (None: no error feedback).
    """

    reply: TrainReply
    history: History
    index_spent: float
    residual: torch.Tensor | None = None


def client_round(
    global_flat: torch.Tensor,
    examples: Split,
    public: PublicRound,
    privacy: RoundPrivacy,
    noise: RoundNoise,
    *,
    model: nn.Module,
    release: Release | None = None,
    residual: torch.Tensor | None = None,
) -> RoundResult:
    """One client's round: local DP-SGD + sparsification from ``global_flat``.

    Order (privacy): the mask is public (seeded, lf's suffix or the server's support) or
    chosen per step by an accounted selector (gip, random-k); each step sparsifies the
    per-sample gradients, clips them, sums and adds noise on the kept coordinates only
    (``common/dp/optimizer.py``). Nothing data-dependent chooses a mask unaccounted.

    Args:
        global_flat: the round's global model, flat (d values).
        examples: the node's training examples.
        public: the round's public instruction.
        privacy: σ, the node's accountant history and index budget, its nominal size.
        noise: seeded streams (simulation) or OS entropy (deployment).
        model: the run's architecture (the process's, ``client/model_cache.py:
            process_model``); its weights are replaced, and Opacus's hooks and the gradients
            are taken off it again before returning.
        release: what the reply reports in the clear (None: ``Release()``, nothing).
        residual: ``error-feedback``'s residual (a float32 vector of length d), or None;
            not modified: the result carries the updated one.

    With ``frozen`` > 0 (lf) the mask keeps ``[frozen, d)`` and the reply carries those
    values only, as a dense vector of ``d - frozen`` values; with an ``explicit`` support
    (ranked, dpssgd) the mask is that support and the reply its values, in support order.
    With a per-step selector (gip, random-k) the reply carries the union of the steps'
    supports explicitly. With a ``residual`` the reply sends the quantized ``values +
    residual`` on the round's support (``feed_back``).
    """
    task = public.task
    secure_mode = privacy.privacy.secure_mode
    layout = ParamLayout.from_module(model)
    numel = layout.numel
    # gip, random-k: each DP step chooses its support (None: one mask for the round).
    selector = public.method.step_selector(
        numel=numel,
        keep_fraction=privacy.keep_fraction,
        budget=privacy.budget,
        seed=noise.index_seed(task.server_round, secure_mode=secure_mode),
    )
    residual = residual.clone() if residual is not None else None
    reply, history = _train(
        global_flat,
        examples,
        public,
        privacy,
        noise,
        model,
        selector,
        release or Release(),
        residual,
    )
    spent = privacy.index_spent + (selector.spent if selector is not None else 0.0)
    return RoundResult(reply, history, spent, residual)


def _train(
    global_flat: torch.Tensor,
    data: Split,
    public: PublicRound,
    round_privacy: RoundPrivacy,
    noise: RoundNoise,
    model: nn.Module,
    selector: StepSelector | None,
    release: Release,
    residual: torch.Tensor | None,
) -> tuple[TrainReply, History]:
    """``client_round``'s training and encoding; ``residual`` is updated in place."""
    cfg, task, frozen, explicit = public.cfg, public.task, public.frozen, public.explicit
    privacy, nominal_size = round_privacy.privacy, round_privacy.nominal_size
    layout = ParamLayout.from_module(model)
    numel = layout.numel
    layout.load_flat_(model, global_flat)
    # The round's public mask: from the broadcast seed (and node id for per-client masks).
    mask_seed = task.mask_seed
    if task.mask_scope == "client":
        mask_seed = client_mask_seed(mask_seed, public.node_id)
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
    train_cfg = TrainConfig(
        epochs=task.local_epochs,
        batch_size=task.batch_size,
        lr=task.lr,
        momentum=task.momentum,
        engine=cfg.engine,
        device=cfg.device,
        seed=noise.train_seed(task.server_round),
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
        engine.accountant.history = list(round_privacy.history)
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
        release_model(model, module)
    # engine.get_epsilon's value, from the memoized accountant (ε of the whole history).
    epsilon = (
        accountant_epsilon(
            engine.accountant.history, delta=privacy.delta, accountant=privacy.accountant
        )
        + round_privacy.index_spent
        + engine.index_epsilon
        if is_private(privacy.mechanism)
        else math.inf
    )

    delta = layout.flatten_module(model).cpu() - global_flat  # the model trained on cfg.device
    # int4/int2/int1's rounding: seeded exactly when the DP noise is (simulation), else OS
    # entropy, so that the server cannot predict it (other dtypes never draw from it)
    rounding = noise.rounding(task.server_round, secure_mode=privacy.secure_mode)
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
    counts = release.example_count
    reply = TrainReply(
        update=payload,
        # Not released by default: 1 and 0 (the server weights updates uniformly).
        num_examples=len(data) if counts else 1,
        examples_seen=examples if counts else 0,
        train_loss=(float(np.nanmean(losses)) if examples else 0.0)
        if release.train_loss and not cfg.secure_aggregation  # nothing in the clear
        else math.nan,
        epsilon=float(epsilon),
        noise_multiplier=float(privacy.noise_multiplier or 0.0),
        keep=int(values.numel()),
        seeded_noise=int(noise.seeded and not privacy.secure_mode),
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
