"""The built-in methods by name, and a user's ``Method`` subclass by ``package.module:Class``.

As Opacus's ``accountants/registry.py`` maps accountant names to classes, ``METHOD_CLASSES``
maps each built-in ``method`` name to its class. Any other ``method`` value must name a
subclass of ``Method`` as ``package.module:Class``; ``method_class`` imports that module.
Importing a module runs its code, so whoever resolves a plug-in name must trust it: a deployed
node checks the name against its owner's list first (``NodePolicy.check_plugins``, before
anything is imported); ``is_plugin`` and ``check_method_name`` never import.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from fedsparse.common import plugins
from fedsparse.common.methods.base import Method
from fedsparse.common.methods.dpssgd import DPSSGD
from fedsparse.common.methods.gip import GIP, RandomK
from fedsparse.common.methods.lf import LayerFreezing
from fedsparse.common.methods.ranked import RankedSparsification
from fedsparse.common.methods.rs import RandomFreeze, RandomSparsification

__all__ = ["METHOD_CLASSES", "check_method_name", "is_plugin", "method_class"]

#: Built-in method name -> class, in the order the docs list them.
METHOD_CLASSES: Final[Mapping[str, type[Method]]] = MappingProxyType(
    {
        cls.name: cls
        for cls in (
            RandomSparsification,
            RandomFreeze,
            LayerFreezing,
            RankedSparsification,
            DPSSGD,
            GIP,
            RandomK,
        )
    }
)


def is_plugin(name: str) -> bool:
    """Whether ``name`` is a ``package.module:Class`` (not a built-in). Imports nothing."""
    return name not in METHOD_CLASSES and plugins.is_reference(name)


def check_method_name(name: str) -> None:
    """Checks that ``name`` is a built-in name or a ``package.module:Class``. Imports nothing.

    Raises:
        ValueError: neither, in one line.
    """
    if name not in METHOD_CLASSES and not is_plugin(name):
        raise ValueError(
            f"method={name!r}: expected one of {', '.join(METHOD_CLASSES)}, or "
            "package.module:Class (a fedsparse.common.methods.Method subclass)"
        )


def method_class(name: str) -> type[Method]:
    """The class of ``method`` ``name``: a built-in's, or a plug-in's (its module imported).

    Raises:
        ValueError: an unknown name, a module that does not import, or a name that is not a
            ``Method`` subclass.
    """
    builtin = METHOD_CLASSES.get(name)
    if builtin is not None:
        return builtin
    check_method_name(name)
    cls = plugins.load(name, field="method")
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise ValueError(
            f"method={name!r}: expected a fedsparse.common.methods.Method subclass, "
            f"got {type(cls).__name__ if cls is None or not isinstance(cls, type) else cls!r}"
        )
    return cls
