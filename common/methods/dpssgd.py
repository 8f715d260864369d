"""``dpssgd``: DP-SSGD ("Differentially Private Sparse SGD with public data pruning",
arXiv:2303.04612).

A slice of the training set, ``public-fraction`` of it, is declared public
(``selection.public_split``; the clients' partitions are drawn from the rest). The model is
pretrained on it without noise for ``public-epochs`` (by the server, in the federation), then
DP-SGD updates only the selected coordinates: in every layer the ``keep_count(n_layer,
final-rate)`` of largest ``|w|`` (``selection=magnitude``, the weights are public: pretrained
on public data or released under DP) or a uniformly random set (``random``), chosen once after
pretraining (``selection-mode=freeze``: parameter freezing) or again each round
(``reselect``). No privacy cost: nothing private chooses the mask. In the federation the
server selects and sends the support as for ``ranked``. Its pruning ratio is ``final-rate``
throughout (schedule ``constant``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from fedsparse.common.masks import derive_seed, keep_count
from fedsparse.common.methods.base import EpochContext, Method, RoundPlan, explicit_support
from fedsparse.common.methods.selection import layer_ranges, layerwise_keep, layerwise_mask
from fedsparse.common.wire.protocol import (
    SERVER_SUPPORT,
    ProtocolError,
    TrainInstruction,
    round_seed,
)

if TYPE_CHECKING:
    from fedsparse.common.layout import ParamLayout
    from fedsparse.common.methods.config import MethodConfig
    from fedsparse.common.methods.schedules import RateSchedule, ScheduleName

__all__ = ["DPSSGD"]


class DPSSGD(Method):
    """``dpssgd``: public pretraining, then DP-SGD on a per-layer selection."""

    name: ClassVar[str] = "dpssgd"
    sends_support: ClassVar[bool] = True
    pretrains_on_public: ClassVar[bool] = True

    def __init__(self, config: MethodConfig) -> None:
        super().__init__(config)
        self._selected: torch.Tensor | None = None  # the selected coordinates (server)

    @classmethod
    def resolve_schedule(cls, schedule: ScheduleName, field: str = "schedule") -> ScheduleName:
        """``constant``: the pruning ratio is ``final-rate`` throughout.

        Raises:
            ValueError: a schedule other than the default ``gradual`` or ``constant``.
        """
        if schedule not in ("gradual", "constant"):
            raise ValueError(
                f"{field}={schedule!r}: method='dpssgd' prunes at final-rate throughout "
                "(schedule 'constant'); leave the schedule unset or set 'constant'"
            )
        return "constant"

    @property
    def public_fraction(self) -> float:
        """``public-fraction``."""
        return self.config.public_fraction

    def _select(
        self, weights: torch.Tensor, layout: ParamLayout, *, rate: float, seed: int
    ) -> None:
        if self._selected is None or self.config.selection_mode == "reselect":
            self._selected = layerwise_mask(
                weights, layout, rate=rate, selection=self.config.selection, seed=seed
            )

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
        """The selection (``freeze``: chosen in the run's first round and kept, in the
        checkpoint too; ``reselect``: chosen again each round from the current model).
        ``random`` draws from the round's public mask seed.

        Raises:
            ValueError: no ``layout``.
        """
        if layout is None:
            raise ValueError("method='dpssgd' needs the model's layout (SparseFedAvg(layout=))")
        rate = schedule.rate(server_round - 1)
        keep = layerwise_keep(layout, rate)
        if keep == weights.numel():
            return RoundPlan(rate=rate, keep=keep)
        self._select(weights, layout, rate=rate, seed=round_seed(seed, server_round))
        assert self._selected is not None
        return RoundPlan(rate=rate, keep=keep, support=torch.nonzero(self._selected).flatten())

    def state_dict(self) -> dict[str, Any]:
        """``dpssgd-selected`` once selected (``freeze`` keeps it)."""
        return {} if self._selected is None else {"dpssgd-selected": self._selected}

    def check_state(self, state: Mapping[str, Any], *, numel: int) -> None:
        """Raises ``ValueError`` unless the selection is bool of shape ``(d,)``."""
        selected = state.get("dpssgd-selected")
        if selected is not None and not (
            isinstance(selected, torch.Tensor)
            and selected.dtype == torch.bool
            and selected.shape == (numel,)
        ):
            raise ValueError(f"dpssgd-selected: expected bool ({numel},)")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The selection, if the checkpoint has one."""
        self._selected = state.get("dpssgd-selected")

    def client_support(
        self,
        task: TrainInstruction,
        raw: object,
        layout: ParamLayout,
        *,
        schedule: RateSchedule,
        final_rate: float,
    ) -> torch.Tensor | None:
        """The server's selection: every layer must hold its own ``keep_count(n_layer, r)``."""
        rate = schedule.rate(task.server_round - 1)
        expected = layerwise_keep(layout, rate)
        support = explicit_support(
            task,
            raw,
            layout,
            expected=expected,
            detail=f"method='dpssgd', final-rate={final_rate}",
            dense_allowed=expected == layout.numel,
        )
        if support is None:
            return None
        for name, start, end in layer_ranges(layout):
            count = int(((support >= start) & (support < end)).sum())
            if count != keep_count(end - start, rate=rate):
                raise ProtocolError(
                    f"train instruction: {SERVER_SUPPORT}: layer {name}: {count} coordinates: "
                    f"expected {keep_count(end - start, rate=rate)} (method='dpssgd')"
                )
        return support

    def epoch_mask(self, ctx: EpochContext) -> tuple[float, torch.Tensor | None, bool]:
        """The selection (again each epoch under ``reselect``) from the current weights."""
        rate = ctx.schedule.rate(ctx.epoch)
        self._select(ctx.weights, ctx.layout, rate=rate, seed=derive_seed(ctx.mask_seed, ctx.epoch))
        assert self._selected is not None
        return rate, None if bool(self._selected.all()) else self._selected, False
