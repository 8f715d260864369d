"""``ranked``: ranked sparsification ("Improving Differentially Private SGD via Randomly
Sparsified Gradients", arXiv:2112.00845, Algorithm 4, App. I).

Epoch 0 trains every coordinate; epoch ``e`` keeps the ``keep`` coordinates of largest
``|z^{e-1}|``, where ``z`` sums the last epoch's perturbed (noisy) gradients plus fresh noise
on the masked coordinates (line 22: else a coordinate masked once would never be ranked up
again). The ranking is post-processing of DP outputs: no privacy cost. ``clean_ranking``
ranks the clipped gradients before noise instead: NOT private (the reported epsilon does not
cover it), only the paper's Figure 12 reference (centralized; ``training.py`` accumulates
``z``).

In the federation (``federated_ranking_scores``) ``z`` is the last round's aggregated update
``w_{r-1} - w_{r-2}``, public to every participant, with fresh noise off its support drawn
from a public seed at the update's own spread. The server always holds both models, a client
only if it trained the round before, so the server ranks and sends the support explicitly (a
bitmap, ``d / 8`` bytes, counted on the downlink); the client replies with the ``keep``
values in support order, values only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from fedsparse.common.masks import keep_count
from fedsparse.common.methods.base import EpochContext, Method, RoundPlan
from fedsparse.common.methods.selection import federated_ranking_scores, ranked_mask
from fedsparse.common.seeds import Stream, stream_seed

if TYPE_CHECKING:
    from fedsparse.common.dp.engine import SparseDPEngine
    from fedsparse.common.layout import ParamLayout
    from fedsparse.common.methods.config import MethodConfig
    from fedsparse.common.methods.schedules import RateSchedule

__all__ = ["RankedSparsification", "RankingEstimate"]


class RankedSparsification(Method):
    """``ranked``: the server ranks the last aggregate and sends the top-``keep`` support
    (a client checks its count against the public schedule: ``Method.client_support``)."""

    name: ClassVar[str] = "ranked"
    sends_support: ClassVar[bool] = True

    def __init__(self, config: MethodConfig) -> None:
        super().__init__(config)
        # The last accepted aggregate w_r - w_{r-1} and the coordinates it covered; None
        # before the first.
        self._ranking: tuple[torch.Tensor, torch.Tensor] | None = None
        self._estimate: RankingEstimate | None = None  # centralized: ``z``, from ``attach``

    def plan_round(
        self,
        *,
        server_round: int,
        weights: torch.Tensor,
        schedule: RateSchedule,
        frozen: int,
        layout: ParamLayout | None,
        seed: int,
    ) -> RoundPlan:
        """The top-``keep`` of the ranking scores; every coordinate before anything is ranked."""
        d = weights.numel()
        rate = schedule.rate(server_round - 1)
        keep = keep_count(d, rate=rate)
        if keep == d:
            return RoundPlan(rate=rate, keep=keep)
        if self._ranking is None:  # nothing to rank yet (Alg. 4, line 6): everything
            return RoundPlan(rate=0.0, keep=d)
        delta, covered = self._ranking
        scores = federated_ranking_scores(
            delta, covered, seed=stream_seed(seed, Stream.RANKING_NOISE, server_round)
        )
        support = torch.nonzero(ranked_mask(scores, keep)).flatten()
        return RoundPlan(rate=rate, keep=keep, support=support)

    def after_round(
        self, *, before: torch.Tensor, after: torch.Tensor, touched: torch.Tensor
    ) -> None:
        """Keeps the aggregate the next round ranks."""
        self._ranking = ((after - before).to(torch.float32), touched.clone())

    def state_dict(self) -> dict[str, Any]:
        """``ranking-delta`` and ``ranking-support`` once a round was aggregated."""
        if self._ranking is None:
            return {}
        return {"ranking-delta": self._ranking[0], "ranking-support": self._ranking[1]}

    def check_state(self, state: Mapping[str, Any], *, numel: int) -> None:
        """Raises ``ValueError`` unless the ranking state is float32/bool of shape ``(d,)``."""
        if "ranking-delta" not in state:
            return
        delta, covered = state["ranking-delta"], state["ranking-support"]
        shapes_ok = delta.shape == covered.shape == (numel,)
        if not (shapes_ok and delta.dtype == torch.float32 and covered.dtype == torch.bool):
            raise ValueError(f"ranking-delta/-support: expected float32/bool ({numel},)")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The ranking state, if the checkpoint has one."""
        if "ranking-delta" in state:
            self._ranking = (state["ranking-delta"], state["ranking-support"])
        else:
            self._ranking = None

    def attach(
        self, engine: SparseDPEngine, optimizer: torch.optim.Optimizer, *, seed: int
    ) -> None:
        """Sums each epoch's perturbed gradients, ``z`` (``training.RankingEstimate``)."""
        self._estimate = RankingEstimate(
            engine, optimizer, clean=self.config.clean_ranking, seed=seed
        )

    def epoch_mask(self, ctx: EpochContext) -> tuple[float, torch.Tensor | None, bool]:
        """Epoch 0 trains everything (Alg. 4, line 6); then the top-``|z|`` coordinates."""
        if self._estimate is None:
            raise RuntimeError("ranked: epoch_mask before attach (the epoch's gradient sums)")
        numel = ctx.layout.numel
        rate = ctx.schedule.rate(ctx.epoch)
        keep = keep_count(numel, rate=rate)
        mask = None if ctx.epoch == 0 or keep == numel else ranked_mask(self._estimate.take(), keep)
        self._estimate.mask = mask
        return rate, mask, False


class RankingEstimate:
    """``z`` of RS Algorithm 4: the sum of an epoch's perturbed gradients (lines 17 and 22).

    After every real optimizer step it adds each parameter's gradient, which ``SparseDPOptimizer``
    left as ``(sum of clipped masked gradients + m * noise) / B``, plus fresh noise
    ``(1 - m) * N(0, (sigma C)^2) / B`` on the masked coordinates, from its own generator
    (``Stream.RANKING_NOISE``: the DP noise stream is untouched). ``clean`` adds the clipped
    sum alone (NOT private; Figure 12's reference).
    """

    def __init__(
        self, engine: SparseDPEngine, optimizer: torch.optim.Optimizer, *, clean: bool, seed: int
    ) -> None:
        self.params = list(engine.named_trainable_parameters().values())
        self.optimizer = optimizer
        self.clean = clean
        self.mask: torch.Tensor | None = None
        self.z = torch.zeros(engine.layout.numel, dtype=torch.float64)
        self.generator = torch.Generator().manual_seed(stream_seed(seed, Stream.RANKING_NOISE))
        inner = getattr(optimizer, "original_optimizer", optimizer)
        inner.register_step_post_hook(self._add)

    def _add(self, *_: object) -> None:
        opt = self.optimizer
        batch = float(getattr(opt, "expected_batch_size", 1) or 1)
        grads = [getattr(p, "summed_grad" if self.clean else "grad", None) for p in self.params]
        if any(g is None for g in grads):  # every trainable parameter has one after a step
            raise RuntimeError("ranked sparsification: a parameter without a gradient")
        flat = torch.cat([g.detach().reshape(-1).cpu() for g in grads if g is not None])
        if self.clean:
            flat = flat / batch
        else:
            sigma = float(getattr(opt, "noise_multiplier", 0.0) or 0.0)
            if self.mask is not None and sigma > 0:
                std = sigma * float(opt.max_grad_norm) / batch  # type: ignore[attr-defined]
                noise = torch.randn(flat.numel(), generator=self.generator) * std
                flat = flat + noise * (~self.mask)
        self.z += flat.to(torch.float64)

    def take(self) -> torch.Tensor:
        """The last epoch's ``z``; the sum starts again from 0 (Alg. 4, line 2)."""
        z, self.z = self.z, torch.zeros_like(self.z)
        return z
