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
calibration and the ledger's charge (``client/train_message.py: prepare_train``, which the
ClientApp every runner sends its messages to calls: Flower's simulation engine, ``RayGrid``'s
workers, ``InProcessGrid`` and a deployed SuperNode). Called with the ClientApp's arguments it
gives the ClientApp's bytes (``tests/client/test_client_round.py``); ``client/population.py:
population_round`` runs it for many clients at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from fedsparse.client.model_cache import release as release_model
from fedsparse.client.round_reply import round_reply
from fedsparse.common import masks
from fedsparse.common.config import FederatedConfig
from fedsparse.common.data.datasets import Split
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
from fedsparse.common.wire.protocol import TrainInstruction, TrainReply, client_mask_seed

__all__ = [
    "LocalTraining",
    "PublicRound",
    "Release",
    "RoundNoise",
    "RoundPrivacy",
    "RoundResult",
    "client_round",
    "round_mask",
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

    @property
    def mask_seed(self) -> int:
        """The seed of the round's mask: the broadcast one, or the node's own under
        ``mask-scope=client``."""
        if self.task.mask_scope == "client":
            return client_mask_seed(self.task.mask_seed, self.node_id)
        return self.task.mask_seed


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


def round_mask(
    public: PublicRound, numel: int, selector: StepSelector | None
) -> torch.Tensor | None:
    """The round's public mask (None: every coordinate, or a per-step ``selector`` chooses):
    from the broadcast seed (and the node id under ``mask-scope=client``), lf's unfrozen
    suffix, or the server's explicit support. A fresh tensor: the DP step holds its own."""
    task, frozen, explicit = public.task, public.frozen, public.explicit
    if selector is not None:  # gip, random-k: no public mask, each step chooses
        return None
    if frozen:
        return suffix_mask(numel, frozen)
    if explicit is not None:
        mask = torch.zeros(numel, dtype=torch.bool)
        mask[explicit] = True
        return mask
    if task.keep == numel:
        return None
    # the process's shared mask, copied: the DP engine holds its own for the round
    return masks.seeded_mask(numel, task.keep, public.mask_seed).clone()


@dataclasses.dataclass(frozen=True)
class LocalTraining:
    """What a round's local training produced (``client_round`` and the population runner).

    Attributes:
        trained: the trained model, flat, on the CPU.
        epoch_losses: each epoch's mean training loss over its real examples (NaN: none).
        examples: the real examples the epochs' batches held, in all.
        history: the node's accountant history after the round.
        index_epsilon: the per-step selector's ε this round (0: none).
    """

    trained: torch.Tensor
    epoch_losses: list[float]
    examples: int
    history: History
    index_epsilon: float = 0.0


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
    cfg, task = public.cfg, public.task
    privacy, nominal_size = round_privacy.privacy, round_privacy.nominal_size
    layout = ParamLayout.from_module(model)
    numel = layout.numel
    layout.load_flat_(model, global_flat)
    mask = round_mask(public, numel, selector)
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
    local = LocalTraining(
        trained=layout.flatten_module(model).cpu(),  # the model trained on cfg.device
        epoch_losses=losses,
        examples=examples,
        history=list(engine.accountant.history),
        index_epsilon=engine.index_epsilon,
    )
    reply = round_reply(
        global_flat,
        len(data),
        public,
        round_privacy,
        noise,
        local,
        mask,
        selector,
        release,
        residual,
    )
    return reply, local.history
