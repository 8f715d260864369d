"""The shared header of every ``summary.json`` (``common/wire/run_log.py``'s docstring):
its keys and types, the config hash, the command line and the software versions."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

__all__ = [
    "SCHEMA",
    "SHARED_SUMMARY_KEYS",
    "SOFTWARE",
    "UNHASHED_KEYS",
    "RunKind",
    "command_line",
    "config_hash",
    "shared_key_problems",
    "software_versions",
    "summary_header",
]

RunKind = Literal["federated", "train"]

#: The version of the ``summary.json`` schema written now (1: before the shared header).
SCHEMA: Final = 2

#: The keys every ``summary.json`` has, federated or ``train``, with their JSON types
#: (``type(None)``: ``null`` where the figure does not apply or is not known).
_FIGURES = ("final_test_accuracy", "final_test_loss", "epsilon_max", "delta", "wall_seconds")
SHARED_SUMMARY_KEYS: Final[dict[str, tuple[type, ...]]] = {
    **dict.fromkeys(("kind", "config_hash"), (str,)),
    **dict.fromkeys(("schema", "parameters"), (int,)),
    **dict.fromkeys(("command", "engine"), (str, type(None))),
    **dict.fromkeys(("versions", "config"), (dict,)),
    **dict.fromkeys(("noise_multiplier_min", "noise_multiplier_max"), (float, type(None))),
    **dict.fromkeys((*_FIGURES, "total_density"), (float,)),
}


def summary_header(
    kind: RunKind,
    *,
    config: Mapping[str, Any],
    command: str | None,
    engine: str | None,
    noise_multiplier_min: float | None,
    noise_multiplier_max: float | None,
) -> dict[str, Any]:
    """The header every ``summary.json`` starts from (module docstring): ``kind``,
    ``schema``, ``command``, ``config_hash`` (of ``config``), ``versions``, ``engine`` and
    the sigma range; both writers (``RunSummary.from_rounds``, ``fedsparse train``) use it."""
    return {
        "kind": kind,
        "schema": SCHEMA,
        "command": command,
        "config_hash": config_hash(config),
        "versions": software_versions(),
        "engine": engine,
        "noise_multiplier_min": noise_multiplier_min,
        "noise_multiplier_max": noise_multiplier_max,
    }


def shared_key_problems(summary: Mapping[str, Any]) -> list[str]:
    """What a decoded ``summary.json`` lacks of ``SHARED_SUMMARY_KEYS``: one line per key
    that is missing or of another JSON type (empty: it has them all)."""
    problems = []
    for key, types in SHARED_SUMMARY_KEYS.items():
        if key not in summary:
            problems.append(f"{key}: missing")
        elif not isinstance(summary[key], types) or isinstance(summary[key], bool):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            problems.append(f"{key}={summary[key]!r}: expected {names}")
    return problems


#: Config keys ``config_hash`` leaves out: where a run writes, not what it computes.
UNHASHED_KEYS: Final = ("out-dir",)


def config_hash(config: Mapping[str, Any]) -> str:
    """The first 16 hex digits of the SHA-256 of ``config``'s canonical JSON (sorted keys, no
    spaces; a value JSON cannot hold is written as its ``str``), ``UNHASHED_KEYS`` left out:
    the same settings run into two directories hash alike."""
    kept = {k: v for k, v in config.items() if k not in UNHASHED_KEYS}
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def command_line(argv: Sequence[str]) -> str:
    """``argv`` as one shell-quoted line, the program by its file name (``fedsparse ...``)."""
    if not argv:
        return ""
    return shlex.join([Path(argv[0]).name, *argv[1:]])


#: The distributions whose versions a run records.
SOFTWARE: Final = ("fedsparse", "flwr", "opacus", "torch")


def software_versions() -> dict[str, str]:
    """The installed versions of ``SOFTWARE`` ("" for one that is not installed)."""
    found = {}
    for name in SOFTWARE:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = ""
    return found
