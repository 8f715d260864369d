"""One rule for turning a config value (TOML, a command line, an environment entry) into a
field's type, shared by the run config, the node policy and the node's data declaration.

* ``bool``: a bool, or ``"true"``/``"false"``/``"1"``/``"0"`` in any case;
* ``int``: an int, an integral float or a numeric string; never a bool;
* ``float``: a number or a numeric string; never a bool;
* ``tuple``: a list or tuple, or a comma-separated string (blank items dropped);
* ``str``: a string, or a number written as one; never a bool.

A value that does not convert is a ``ValueError`` naming the key and the value, in the form
every config error takes: ``key=value: expected kind``. An unknown key's error names the
closest known keys (``unknown_key``), or all of them when none is close.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

__all__ = ["coerce", "unknown_key"]

_TRUE, _FALSE = ("true", "1"), ("false", "0")


def coerce(key: str, value: Any, kind: type, *, where: str = "") -> Any:
    """``value`` as ``kind`` (module rules).

    Args:
        key: the key, as the user wrote it (named in the error).
        where: what the key belongs to, put before it in the error (``"node policy"``).

    Raises:
        ValueError: ``{where}: {key}={value!r}: expected {kind}``.
    """
    prefix = f"{where}: " if where else ""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise ValueError(f"{prefix}{key}={value!r}: expected true or false")
    if kind is tuple:
        items = value if isinstance(value, list | tuple) else str(value).split(",")
        return tuple(str(item).strip() for item in items if str(item).strip())
    if not isinstance(value, bool):
        try:
            if kind is int:
                if isinstance(value, float) and not value.is_integer():
                    raise ValueError
                return int(value)
            if kind is float:
                return float(value)
            if kind is str:
                return str(value)
        except (TypeError, ValueError):
            pass
    raise ValueError(f"{prefix}{key}={value!r}: expected {kind.__name__}")


def unknown_key(what: str, key: str, known: Iterable[str]) -> str:
    """The error for an unknown ``key`` among ``known`` (dashes or underscores alike): the
    closest known keys when there are any (``did you mean``), else all of them."""
    names = sorted(k.replace("_", "-") for k in known)
    close = difflib.get_close_matches(key.replace("_", "-"), names, n=3, cutoff=0.7)
    if close:
        return f"{what} {key!r} is unknown; did you mean {' or '.join(map(repr, close))}?"
    return f"{what} {key!r} is unknown; known keys: {', '.join(names)}"
