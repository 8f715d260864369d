"""Old import names (``common/moved.py``): each answers with the module that now holds it."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from fedsparse.common.moved import MOVED


def _fresh(name: str) -> object:
    sys.modules.pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    assert any(
        issubclass(w.category, DeprecationWarning) and name in str(w.message) for w in caught
    )
    return module


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_name_holds_the_new_modules_objects(old: str) -> None:
    new = MOVED[old]
    module = _fresh(old)
    if isinstance(new, str):
        assert module is importlib.import_module(new)
        return
    for part in new:
        target = importlib.import_module(part)
        names = getattr(target, "__all__", [n for n in vars(target) if not n.startswith("_")])
        for name in names:
            assert getattr(module, name) is getattr(target, name), f"{old}.{name} from {part}"


def test_the_old_and_new_names_share_classes() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from fedsparse.common.privacy import calibrate_noise_multiplier as old
        from fedsparse.common.robust import HonestClientBound as old_bound
    from fedsparse.common.aggregation.norm_bounds import HonestClientBound
    from fedsparse.common.dp.accounting import calibrate_noise_multiplier

    assert old is calibrate_noise_multiplier
    assert old_bound is HonestClientBound


def test_no_alias_shadows_a_module_that_exists() -> None:
    """An alias for a name that is also a real module would hide the real one."""
    for old in MOVED:
        parent, _, leaf = old.rpartition(".")
        if parent in MOVED:  # an old package's old submodule: its parent is an alias too
            continue
        spec = importlib.util.find_spec(parent)
        assert spec is not None and spec.submodule_search_locations
        for location in spec.submodule_search_locations:
            path = Path(location)
            assert not (path / f"{leaf}.py").exists() and not (path / leaf).is_dir(), old


@pytest.mark.slow
def test_a_recorded_python_m_command_still_runs() -> None:
    """``python -m fedsparse.lab.compose`` wrote the committed compose files' headers."""
    out = subprocess.run(
        [sys.executable, "-m", "fedsparse.lab.compose", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "--nodes" in out.stdout and "--overlay" in out.stdout


def test_an_alias_leaves_the_module_its_own_spec() -> None:
    """Importing the old name does not rename the module (``reload`` and ``find_spec`` work)."""
    _fresh("fedsparse.common.privacy")
    from fedsparse.common.dp import accounting

    assert accounting.__spec__ is not None
    assert accounting.__spec__.name == "fedsparse.common.dp.accounting"
    assert importlib.reload(accounting) is accounting


def test_a_moved_packages_submodules_are_not_imported_twice() -> None:
    """``fedsparse.common.engines`` moved: its submodule ``func`` is the new package's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module("fedsparse.common.engines.func")
    assert old is importlib.import_module("fedsparse.common.dp.engines.func")
