"""``MethodConfig``: which method runs and its parameters, as the config and CLI give them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, get_args

from fedsparse.common.coerce import unknown_key
from fedsparse.common.methods.base import Method
from fedsparse.common.methods.index_selection import DEFAULT_INDEX_FRACTION
from fedsparse.common.methods.registry import check_method_name, method_class
from fedsparse.common.methods.selection import SELECTIONS, SelectionName
from fedsparse.common.names import SELECTION_MODES, FederatedMethodName, MethodName, SelectionMode

if TYPE_CHECKING:
    from fedsparse.common.layout import ParamLayout
    from fedsparse.common.methods.schedules import ScheduleName

__all__ = [
    "FEDERATED_METHODS",
    "METHODS",
    "SELECTION_MODES",
    "FederatedMethodName",
    "MethodConfig",
    "MethodName",
    "SelectionMode",
    "method_schedule",
]


METHODS: Final[tuple[MethodName, ...]] = get_args(MethodName)


FEDERATED_METHODS: Final[tuple[FederatedMethodName, ...]] = get_args(FederatedMethodName)


def method_schedule(method: str, schedule: ScheduleName, field: str = "schedule") -> ScheduleName:
    """The rate schedule ``method`` runs: ``cooling`` for ``random-freeze``, ``constant`` for
    ``dpssgd`` (its pruning ratio is ``final-rate`` throughout), else ``schedule``
    (``Method.resolve_schedule``; a plug-in's module is imported).

    Raises:
        ValueError: ``random-freeze`` with a schedule other than the default ``gradual`` or
            ``cooling`` (random freeze *is* the cooling schedule); ``dpssgd`` with one other
            than ``gradual`` or ``constant``.
    """
    return method_class(method).resolve_schedule(schedule, field)


@dataclass(frozen=True, kw_only=True)
class MethodConfig:
    """The method and its own parameters (``freeze_*`` apply to ``lf`` only).

    Attributes:
        name: one of ``METHODS``, or a plug-in's ``package.module:Class``.
        freeze_layers: ``m_f``, layers frozen from ``freeze_after`` on (``lf``: >= 1).
        freeze_after: ``t_f``, the first 0-based step (epoch, or round - 1) that freezes.
    """

    name: str = "rs"
    freeze_layers: int = 1
    freeze_after: int = 0
    #: ``ranked`` only: rank without the noise (NOT private; Figure 12's reference).
    clean_ranking: bool = False
    #: ``dpssgd`` only (``dpssgd.py``).
    public_fraction: float = 0.1
    public_epochs: int = 5
    selection: SelectionName = "magnitude"
    selection_mode: SelectionMode = "freeze"
    #: ``gip`` only: the share of ``target-epsilon`` spent on the indices (``eps2``).
    index_budget_fraction: float = DEFAULT_INDEX_FRACTION
    #: ``gip`` and ``random-k``: GIP's group length ``l``.
    group_size: int = 256
    #: A plug-in's own keys (``Method.options``) as (key, value) pairs; unset ones take
    #: the class's defaults (``Method.option``).
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        check_method_name(self.name)
        if self.freeze_layers < 1:
            raise ValueError(f"freeze-layers={self.freeze_layers}: expected >= 1")
        if self.freeze_after < 0:
            raise ValueError(f"freeze-after={self.freeze_after}: expected >= 0")
        if not 0.0 < self.public_fraction < 1.0:
            raise ValueError(f"public-fraction={self.public_fraction}: expected 0 < f < 1")
        if self.public_epochs < 0:
            raise ValueError(f"public-epochs={self.public_epochs}: expected >= 0")
        if self.selection not in SELECTIONS:
            raise ValueError(
                f"selection={self.selection!r}: expected one of {', '.join(SELECTIONS)}"
            )
        if self.selection_mode not in SELECTION_MODES:
            raise ValueError(
                f"selection-mode={self.selection_mode!r}: expected one of "
                f"{', '.join(SELECTION_MODES)}"
            )
        if not 0.0 < self.index_budget_fraction < 1.0:
            raise ValueError(
                f"index-budget-fraction={self.index_budget_fraction}: expected 0 < f < 1"
            )
        if self.group_size < 2:
            raise ValueError(f"group-size={self.group_size}: expected >= 2")
        if self.clean_ranking and self.name != "ranked":
            raise ValueError(f"clean_ranking=True: only with method='ranked' (got {self.name!r})")

    def method(self) -> Method:
        """A fresh instance of the method (its server state, if any, starts empty).

        Raises:
            ValueError: a plug-in name that does not resolve (``registry.method_class``), or
                an option the method does not declare.
        """
        cls = method_class(self.name)
        for key, _ in self.options:
            if key not in cls.options:
                raise ValueError(unknown_key(f"method={self.name!r}: key", key, cls.options))
        return cls(self)

    @property
    def selects_per_step(self) -> bool:
        """Whether each DP step chooses its own support (``gip``, ``random-k``)."""
        return method_class(self.name).selects_per_step

    def frozen(self, layout: ParamLayout, step: int) -> int:
        """``s``: the frozen coordinate prefix at 0-based ``step`` (0: nothing frozen).

        Raises:
            ValueError: ``freeze_layers`` leaves no layer to train (``frozen_prefix``).
        """
        method = self.method()
        return method.frozen_at(step, method.frozen_prefix(layout))

    def check(self, layout: ParamLayout) -> None:
        """Checks the method's parameters against the model (``lf``: enough layers)."""
        self.method().check_layout(layout)
