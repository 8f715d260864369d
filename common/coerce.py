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

Several keys may travel in one string value, ``key=value;key=value`` (``parse_pairs``,
``format_pairs``): how a plug-in's own keys pass through a config that takes only the keys it
declares (run-config key ``method-options``).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["coerce", "format_pairs", "parse_pairs", "unknown_key"]

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


def parse_pairs(key: str, text: Any) -> dict[str, str]:
    """``key``'s value ``key=value;key=value`` as a mapping, in order (blank items dropped,
    keys and values stripped; a value may hold ``=``, not ``;``).

    Raises:
        ValueError: ``{key}={text!r}: expected key=value;key=value ...``: an item without
            ``=`` or without a key, a key given twice, or a value that is not a string.
    """
    if not isinstance(text, str):
        raise ValueError(f"{key}={text!r}: expected key=value;key=value (a string)")
    pairs: dict[str, str] = {}
    for item in text.split(";"):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"{key}={text!r}: expected key=value;key=value ({item.strip()!r})")
        if name in pairs:
            raise ValueError(f"{key}={text!r}: expected each key once ({name!r} twice)")
        pairs[name] = value.strip()
    return pairs


def format_pairs(key: str, values: Mapping[str, Any]) -> str:
    """``values`` as ``key``'s ``k=v;k=v`` string (``parse_pairs`` reads it back; each value
    is written so that ``coerce`` returns it: bools as ``true``/``false``, tuples
    comma-separated, numbers as ``repr`` writes them).

    Raises:
        ValueError: a value that cannot be written (one holding ``;``, a tuple item holding
            ``,``), naming the key in ``key``.
    """
    items = []
    for name, value in values.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, list | tuple):
            if any("," in str(v) or ";" in str(v) for v in value):
                raise ValueError(f"{key}: {name}={value!r}: expected items without , or ;")
            text = ",".join(str(v) for v in value)
        else:
            text = repr(value) if isinstance(value, float) else str(value)
        if ";" in text or text != text.strip():
            raise ValueError(f"{key}: {name}={value!r}: expected no ; and no edge spaces")
        items.append(f"{name}={text}")
    return ";".join(items)
