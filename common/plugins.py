"""A user's own model, dataset or method, named in a config as ``package.module:attribute``.

The built-in registries (``models.MODEL_NAMES``, ``data.DATASET_NAMES``, the methods) are
closed lists of names; a name of the form ``package.module:attribute`` instead names an object
in an importable module, the way Flower's ``serverapp = "package.module:app"`` and
``entry_points`` do::

    model=my_lab.nets:small_cnn        # a callable (num_classes=...) -> nn.Module
    dataset=my_lab.data:load           # a callable (data_dir=..., seed=...) -> (train, test)

``load`` imports the module, so only code already installed where the run happens can be
named. Importing runs the module's code: where the config comes from someone else (a deployed
node, whose server is not trusted), the caller must check the reference against what the
node's owner allows BEFORE calling ``load`` (``is_reference`` tells a reference from a
built-in name without importing anything).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable
from typing import Any, Final, TypeVar

__all__ = ["REFERENCE_FORMAT", "is_reference", "load", "load_instance", "unknown_name"]

T = TypeVar("T")

REFERENCE_FORMAT: Final = "package.module:attribute"

_IDENTIFIER: Final = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED: Final = rf"{_IDENTIFIER}(?:\.{_IDENTIFIER})*"
_REFERENCE: Final = re.compile(rf"{_DOTTED}:{_DOTTED}")


def is_reference(name: str) -> bool:
    """Whether ``name`` is a ``package.module:attribute`` reference (nothing is imported)."""
    return isinstance(name, str) and _REFERENCE.fullmatch(name) is not None


def load(reference: str, *, field: str) -> Any:
    """The object ``reference`` names, its module imported.

    Args:
        reference: ``package.module:attribute`` (the attribute may be dotted: ``mod:Cls.make``).
        field: the config key, for error messages (``model``, ``dataset``, ``method``).

    Raises:
        ValueError: ``reference`` is not of that form, its module cannot be imported (the
            message carries the import error) or has no such attribute.
    """
    if not is_reference(reference):
        raise ValueError(f"{field}={reference!r}: expected a name or {REFERENCE_FORMAT}")
    module_name, _, attribute = reference.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as err:
        # The missing module's name only: the error's own text can hold the node's paths,
        # and on a deployed node this message is the server's reply (the cause stays local).
        missing = f" (no module {err.name!r})" if err.name and err.name != module_name else ""
        raise ValueError(
            f"{field}={reference!r}: cannot import {module_name!r}{missing}; is it installed, "
            "or on PYTHONPATH, where the run happens?"
        ) from err
    except Exception as err:  # the module itself failed: its text may name files, data
        raise ValueError(
            f"{field}={reference!r}: importing {module_name!r} raised "
            f"{type(err).__name__} (the message stays where the run happens)"
        ) from err
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(
                f"{field}={reference!r}: module {module_name!r} has no attribute {attribute!r}"
            ) from None
    return target


def load_instance(reference: str, *, field: str, kind: type[T]) -> T:
    """``load(reference)``, which must be an instance of ``kind`` (an ``EngineSpec``, a
    ``BackendSpec``: a registration a user writes in their own module).

    Raises:
        ValueError: as ``load``, or the object is not a ``kind`` (naming both).
    """
    target = load(reference, field=field)
    if not isinstance(target, kind):
        raise ValueError(
            f"{field}={reference!r}: expected a {kind.__module__}.{kind.__qualname__}, got "
            f"{type(target).__name__}"
        )
    return target


def unknown_name(field: str, value: str, names: Iterable[str], what: str) -> str:
    """The error for a ``field`` value that is neither a built-in name nor a reference to
    ``what`` (``"an EngineSpec"``)."""
    return f"{field}={value!r}: expected one of {', '.join(names)}, or {REFERENCE_FORMAT} ({what})"
