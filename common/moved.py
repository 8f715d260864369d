"""Import names from before modules were grouped by concept, kept working as aliases.

``fedsparse.common.privacy`` is now ``fedsparse.common.dp.accounting``, ``fedsparse.lab.compose``
is ``fedsparse.lab.launch.compose``, and so on (``MOVED``; CHANGELOG.md, "Layout"). A finder at
the front of ``sys.meta_path`` answers an old name with the module under its new name, the same
module object, so classes keep one identity and ``python -m fedsparse.lab.compose`` still runs.
An old module that was split in parts (``fedsparse.common.robust`` into ``aggregation/robust.py``
and ``aggregation/norm_bounds.py``) is answered by a module holding every part's public names
(the same objects); ``python -m`` runs its first part. Each old name warns once
(``DeprecationWarning``) when first imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import CodeType, ModuleType
from typing import Final

__all__ = ["MOVED", "install"]

#: old import name -> new import name, or the new modules it was split into.
MOVED: Final[dict[str, str | tuple[str, ...]]] = {
    "fedsparse.common.aggregate": "fedsparse.common.aggregation.sparse",
    "fedsparse.common.central_dp": "fedsparse.common.dp.central",
    "fedsparse.common.engines": "fedsparse.common.dp.engines",
    "fedsparse.common.factored_dp": (
        "fedsparse.common.dp.engines.factored",
        "fedsparse.common.dp.engines.factored_layers",
    ),
    "fedsparse.common.func_dp": "fedsparse.common.dp.engines.func",
    "fedsparse.common.gip": "fedsparse.common.methods.index_selection",
    "fedsparse.common.ledger": "fedsparse.client.ledger",
    "fedsparse.common.mallows": "fedsparse.common.methods.mallows",
    "fedsparse.common.node_data": "fedsparse.client.node_data",
    "fedsparse.common.node_policy": "fedsparse.client.node_policy",
    "fedsparse.common.partition": "fedsparse.common.data.partition",
    "fedsparse.common.payload": "fedsparse.common.wire.payload",
    "fedsparse.common.payload.api": "fedsparse.common.wire.payload.api",
    "fedsparse.common.payload.compression": "fedsparse.common.wire.payload.compression",
    "fedsparse.common.payload.indices": "fedsparse.common.wire.payload.indices",
    "fedsparse.common.payload.lowbit": "fedsparse.common.wire.payload.lowbit",
    "fedsparse.common.payload.schema": "fedsparse.common.wire.payload.schema",
    "fedsparse.common.payload.sizing": "fedsparse.common.wire.payload.sizing",
    "fedsparse.common.payload.update": "fedsparse.common.wire.payload.update",
    "fedsparse.common.payload.values": "fedsparse.common.wire.payload.values",
    "fedsparse.common.privacy": "fedsparse.common.dp.accounting",
    "fedsparse.common.protocol": "fedsparse.common.wire.protocol",
    "fedsparse.common.records": "fedsparse.common.wire.run_log",
    "fedsparse.common.robust": (
        "fedsparse.common.aggregation.robust",
        "fedsparse.common.aggregation.norm_bounds",
    ),
    "fedsparse.common.scaling": "fedsparse.common.dp.scaling",
    "fedsparse.common.scattering": "fedsparse.common.models.scattering",
    "fedsparse.common.schedules": "fedsparse.common.methods.schedules",
    "fedsparse.lab.attacks": "fedsparse.lab.research.attacks",
    "fedsparse.lab.compose": (
        "fedsparse.lab.launch.compose",
        "fedsparse.lab.launch.compose_check",
    ),
    "fedsparse.lab.deploy": "fedsparse.lab.launch.deploy",
    "fedsparse.lab.export": "fedsparse.lab.experiments.export",
    "fedsparse.lab.flower": "fedsparse.lab.launch.flower",
    "fedsparse.lab.inprocess": "fedsparse.lab.simulation.inprocess",
    "fedsparse.lab.inverting": "fedsparse.lab.research.inversion",
    "fedsparse.lab.memory": "fedsparse.lab.simulation.memory",
    "fedsparse.lab.netns": "fedsparse.lab.launch.netns",
    "fedsparse.lab.processes": "fedsparse.lab.launch.processes",
    "fedsparse.lab.raygrid": (
        "fedsparse.lab.simulation.raygrid",
        "fedsparse.lab.simulation.rayworkers",
    ),
    "fedsparse.lab.relay": "fedsparse.lab.launch.relay",
    "fedsparse.lab.report": "fedsparse.lab.experiments.report",
    "fedsparse.lab.reproduce": "fedsparse.lab.research.reproduction",
    "fedsparse.lab.reproduce_report": (
        "fedsparse.lab.research.reproduction.report",
        "fedsparse.lab.research.reproduction.sections",
        "fedsparse.lab.research.reproduction.figures",
    ),
    "fedsparse.lab.simulate": "fedsparse.lab.launch.simulate",
    "fedsparse.lab.stats": "fedsparse.lab.experiments.stats",
    "fedsparse.lab.sweep": (
        "fedsparse.lab.experiments.sweep",
        "fedsparse.lab.experiments.sweep_plan",
        "fedsparse.lab.experiments.sweep_backends",
    ),
    "fedsparse.lab.timing": "fedsparse.lab.experiments.timing",
    "fedsparse.lab.tls": "fedsparse.lab.launch.tls",
    "fedsparse.lab.train": "fedsparse.lab.experiments.train",
    "fedsparse.lab.tuning": "fedsparse.lab.experiments.tuning",
    "fedsparse.lab.wire": "fedsparse.lab.launch.wire",
}


def _public(module: ModuleType) -> dict[str, object]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")]
    return {name: getattr(module, name) for name in names}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module imported under its new name (or its parts' union)."""

    def __init__(self, new: str | tuple[str, ...]) -> None:
        self.parts = (new,) if isinstance(new, str) else new
        self._own: tuple[object, object] | None = None  # the module's own __spec__, __loader__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {' and '.join(self.parts)}; the old name is an alias",
            DeprecationWarning,
            stacklevel=2,
        )
        modules = [importlib.import_module(part) for part in self.parts]
        if len(modules) == 1:
            # importlib sets the old name's spec on the module: put its own back afterwards
            self._own = (modules[0].__spec__, getattr(modules[0], "__loader__", None))
            return modules[0]
        union = ModuleType(spec.name, modules[0].__doc__)
        for module in reversed(modules):  # the first part's name wins
            vars(union).update(_public(module))
        union.__all__ = sorted(set().union(*(_public(m) for m in modules)))  # type: ignore[attr-defined]
        return union

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new modules already ran. The module keeps its own spec, so
        ``importlib.reload`` and ``find_spec`` of its new name still work."""
        if self._own is not None:
            module.__spec__, module.__loader__ = self._own  # type: ignore[assignment]

    def get_code(self, fullname: str) -> CodeType | None:
        """The (first) new module's code, for ``python -m OLD_NAME`` (run as ``__main__``)."""
        spec = importlib.util.find_spec(self.parts[0])
        loader = spec.loader if spec is not None else None
        get_code = getattr(loader, "get_code", None)
        return get_code(self.parts[0]) if get_code is not None else None


def _new_name(old: str) -> str | tuple[str, ...] | None:
    """``MOVED[old]``, or for a submodule of a moved package its name under the new one
    (``fedsparse.common.engines.func`` is ``fedsparse.common.dp.engines.func``), so that no
    module is imported twice under two names."""
    if old in MOVED:
        return MOVED[old]
    parent, _, leaf = old.rpartition(".")
    while parent:
        new = MOVED.get(parent)
        if isinstance(new, str):
            candidate = f"{new}.{old[len(parent) + 1 :]}"
            return candidate if importlib.util.find_spec(candidate) is not None else None
        parent, _, leaf = parent.rpartition(".")
    return None


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = _new_name(fullname)
        if new is None:
            return None
        first = new if isinstance(new, str) else new[0]
        origin = importlib.util.find_spec(first)
        return importlib.util.spec_from_loader(
            fullname,
            _Alias(new),
            origin=origin.origin if origin is not None else None,
            is_package=bool(
                isinstance(new, str) and origin is not None and origin.submodule_search_locations
            ),
        )


def install() -> None:
    """Puts the alias finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
