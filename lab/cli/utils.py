"""What every command of ``fedsparse`` shares: the console, name checks, ``--set`` parsing.

Light on purpose: ``fedsparse --help`` and a command's usage errors import only this, typer
and rich; torch, Flower, Opacus and Ray load inside the commands that run something.
"""

from __future__ import annotations

import difflib
import math
import shutil
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

__all__ = [
    "CARRIER",
    "OverwriteRuns",
    "ResumeRuns",
    "STATE",
    "carry_method_options",
    "check_grid_values",
    "check_run_config",
    "Opt",
    "choice",
    "console",
    "parse_sets",
    "rate",
    "removed_on_failed_start",
]

Choice = TypeVar("Choice", bound=str)

Opt = typer.Option

#: ``--resume`` and ``--overwrite`` of a command that writes many runs under a runs-dir
#: (``sweep``, ``frontier``, ``reproduce``: ``run_dir.claim_runs``).
ResumeRuns = Annotated[
    bool, Opt(help="reuse the finished runs in the runs-dir (a run of other inputs is refused)")
]
OverwriteRuns = Annotated[bool, Opt(help="start over: remove the runs the runs-dir holds first")]

console = Console()
if not console.is_terminal:  # logs and CI: do not squeeze the round table into 80 columns
    console = Console(width=140)

#: What ``main`` needs to know of the command's run: ``--debug``, the stopping signal.
STATE: dict[str, Any] = {"debug": False, "signal": None}


def choice(
    field: str,
    value: str,
    choices: Sequence[Choice],
    *,
    aliases: Mapping[str, str] = {},
    plugin: bool = False,
) -> Choice:
    """``value`` as the one of ``choices`` it names (directly or through ``aliases``), or with
    ``plugin`` a user's ``package.module:attribute`` (``common/plugins.py``; not imported here).

    Raises:
        ValueError: none of them (naming ``field`` and ``value``, and the closest choice).
    """
    if plugin:
        from fedsparse.common.plugins import is_reference

        if is_reference(value):
            return value  # type: ignore[return-value]
    for option in choices:
        if aliases.get(value, value) == option or value == option:
            return option
    close = difflib.get_close_matches(value, list(choices), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    more = " or package.module:attribute" if plugin else ""
    raise ValueError(f"{field}={value!r}: expected one of {', '.join(choices)}{more}{hint}")


def rate(field: str, text: str | None) -> float | None:
    """A link rate option in bit/s (``lab/launch/netns.py:parse_rate``), or None if not given."""
    from fedsparse.lab.launch.netns import parse_rate

    return None if text is None else parse_rate(text, field=field)


def parse_sets(items: list[str]) -> dict[str, str]:
    """``--set key=value`` options as a mapping (the last of a repeated key wins), a plug-in
    method's own keys in ``method-options`` (``carry_method_options``).

    Raises:
        typer.BadParameter: an item without ``=`` or without a key, or a plug-in's key given
            both on its own and in ``method-options``.
    """
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"--set {item!r}: expected key=value")
        overrides[key.strip()] = value.strip()
    try:
        return carry_method_options(overrides)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err


def carry_method_options(overrides: Mapping[str, str]) -> dict[str, str]:
    """``overrides`` with every key the app does not declare moved into ``method-options``
    (``key=value;key=value``) when ``method`` names a plug-in (``package.module:Class``).

    Flower's ``flwr run --run-config`` takes only the keys ``[tool.flwr.app.config]``
    declares, so a plug-in method's own keys (``Method.options``) travel in that one declared
    key. Nothing is imported here: whether the plug-in declares them is checked when the
    config is parsed (``FederatedConfig.from_run_config``), as is every other key. Without a
    plug-in method the mapping is returned as it is (an undeclared key is then an error).

    Raises:
        ValueError: a key given both on its own and in ``method-options``.
    """
    from fedsparse.common.coerce import format_pairs, parse_pairs
    from fedsparse.common.plugins import is_reference

    if not is_reference(overrides.get("method", "")):
        return dict(overrides)
    declared = _declared_keys()
    own = {k: v for k, v in overrides.items() if k.replace("_", "-") not in declared}
    if not own:
        return dict(overrides)
    carried = parse_pairs(CARRIER, overrides.get(CARRIER, ""))
    for key in own.keys() & carried.keys():
        raise ValueError(f"--set {key}={own[key]}: also in {CARRIER}={overrides[CARRIER]!r}")
    rest = {k: v for k, v in overrides.items() if k not in own}
    return {**rest, CARRIER: format_pairs(CARRIER, {**carried, **own})}


#: The app's ``pyproject.toml`` (``lab/launch/flower.py:APP_DIR``'s, found without importing that
#: module, which loads torch): its ``[tool.flwr.app.config]`` lists every run-config key with a
#: default of the key's type (``tests/common/test_config.py`` keeps it equal to the config).
APP_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


#: The run-config key that carries a plug-in method's own keys (``common/config_keys.py``'s
#: ``METHOD_OPTIONS``, named here without importing it).
CARRIER = "method-options"
#: ``--extend-corners``'s default (``sweep --tune``, ``frontier``): each numeric tuning axis of
#: an arm goes at most this many steps past its grid (``lab/experiments/corners.py``; 0: the
#: grid as given).
DEFAULT_EXTEND_CORNERS = 2


def _app_config() -> dict[str, Any] | None:
    """``[tool.flwr.app.config]`` of the app's ``pyproject.toml``, or None without one."""
    import tomllib

    try:
        config = tomllib.loads(APP_PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return None
    return dict(config)


def _declared_keys() -> set[str]:
    """The run-config keys: ``[tool.flwr.app.config]``'s, or (an installed package without
    the app's ``pyproject.toml``) ``FederatedConfig``'s."""
    declared = _app_config()
    if declared is None:
        from fedsparse.common.config import run_config_fields

        return {f.name.replace("_", "-") for f in run_config_fields()}
    return set(declared)


def check_run_config(overrides: Mapping[str, str]) -> None:
    """Fails fast on an unknown run-config key, a value of the wrong scalar type, or a value
    out of its range, names or combinations (``common/config_values.py: check_values``).

    The same errors, word for word, as ``FederatedConfig.from_run_config`` raises for them,
    found in milliseconds instead of the seconds the config module takes to import (it
    loads torch and Opacus): the checks that need a method's class or the model still run
    when the command starts. Without the app's ``pyproject.toml`` (an installed,
    non-editable package), there is nothing to check here and the full check alone runs.

    Raises:
        ValueError: ``run config key 'num-round' is unknown; did you mean 'num-rounds'?``,
            ``key=value: expected int`` (bool, int and float keys), or
            ``final-rate=1.5: expected 0 <= r < 1``.
    """
    from fedsparse.common.coerce import coerce, unknown_key
    from fedsparse.common.config_values import check_values

    declared = _app_config()
    if declared is None:
        return
    values = dict(declared)
    for key, value in overrides.items():
        name = key.replace("_", "-")
        default = declared.get(name)
        if default is None:
            raise ValueError(unknown_key("run config key", key, declared))
        kind = type(default) if isinstance(default, bool | int | float) else str
        values[name] = coerce(key, value, kind)
    check_values({key.replace("-", "_"): value for key, value in values.items()})


@contextmanager
def removed_on_failed_start(out: Path) -> Iterator[None]:
    """Removes ``out`` again if this command created it and then failed to start the run
    (``ValueError``: a config, resume, data or ``--out`` problem): a failed start leaves
    nothing behind. An ``out`` that existed before is left as it was."""
    existed = out.exists()
    try:
        yield
    except ValueError:
        if not existed:
            shutil.rmtree(out, ignore_errors=True)
        raise


def check_grid_values(grid: Sequence[str], fixed: Mapping[str, str]) -> None:
    """``check_run_config`` for every point of the grid ``--grid key=v1,v2,...`` spans (their
    cartesian product, with the fixed ``--set`` values and a plug-in method's own keys moved
    into ``method-options``), before the heavy imports; malformed entries are left to the full
    parse, and a grid of more than ``GRID_POINTS_CHECKED`` points to it as well.

    Raises:
        ValueError: a point ``check_run_config`` refuses (named).
    """
    import itertools

    axes: list[list[tuple[str, str]]] = []
    for entry in grid:
        key, sep, values = entry.partition("=")
        if sep:
            axes.append([(key.strip(), v.strip()) for v in values.split(",") if v.strip()])
    if math.prod(len(axis) for axis in axes) > GRID_POINTS_CHECKED:
        return
    for point in itertools.product(*axes):
        check_run_config(carry_method_options({**fixed, **dict(point)}))


#: The most grid points ``check_grid_values`` checks one by one (each takes well under a ms).
GRID_POINTS_CHECKED = 20_000
