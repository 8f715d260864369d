"""A user's backend from a package outside the repository, by ``--backend package.module:spec``.

The package (``tests/plugin_package.py``: ``backends.counting``) is written into ``tmp_path``
and put on ``sys.path``; fedsparse is not touched and nothing is registered: the file and its
``BackendSpec`` are the whole extension. Its grid is ``InProcessGrid`` with every send counted,
so its effect is exact: a run on it ends bit for bit where ``--backend inprocess`` ends, its
count says it carried the messages, and its inputs record its reference and code version.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fedsparse.lab.cli.app import app
from fedsparse.lab.launch.backends import backend_spec, check_backend, traits
from fedsparse.lab.launch.run_dir import INPUTS_FILE, plugin_version
from fedsparse.lab.simulation.api import simulate
from tests.plugin_package import PACKAGE, user_package

SPEC = f"{PACKAGE}.backends:counting"
ONE_ROUND = ["--set", "num-rounds=1", "--set", "min-clients=2", "--set", "final-rate=0"]


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The user package on ``sys.path``, not yet imported; its backend's reference."""
    with user_package(tmp_path / "site", monkeypatch):
        yield SPEC


def _simulate(out: Path, backend: str) -> None:
    args = ["simulate", "--out", str(out), "--backend", backend, "--clients", "2", *ONE_ROUND]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output


def test_a_plugin_backend_runs_a_simulation_as_the_grid_it_extends(
    plugin: str, tmp_path: Path
) -> None:
    _simulate(tmp_path / "plugin", plugin)
    sent = sys.modules[f"{PACKAGE}.backends"].SENT
    assert 2 in sent  # the round's two train messages went through its grid
    _simulate(tmp_path / "inprocess", "inprocess")
    ours = torch.load(tmp_path / "plugin" / "checkpoint.pt")["weights"]
    theirs = torch.load(tmp_path / "inprocess" / "checkpoint.pt")["weights"]
    assert torch.equal(ours, theirs)
    inputs = json.loads((tmp_path / "plugin" / INPUTS_FILE).read_text())
    assert inputs["results"] == plugin  # its own family: a run resumes on it only
    assert inputs["plugins"] == {"backend": f"{plugin} @ {plugin_version(plugin)}"}


def test_the_python_api_runs_a_plugin_backend(plugin: str, tmp_path: Path) -> None:
    summary = simulate(
        {"num-rounds": 1, "min-clients": 2, "final-rate": 0},
        clients=2,
        backend=plugin,
        out=tmp_path / "run",
    )
    assert summary is not None and sys.modules[f"{PACKAGE}.backends"].SENT


def test_a_backend_reference_must_name_an_in_process_backend_spec(plugin: str) -> None:
    assert check_backend(plugin) == plugin and check_backend("simulation") == "flower"
    assert traits(plugin).in_process and backend_spec(plugin).name == "counting"
    with pytest.raises(ValueError, match=r"traits .*: a user's backend runs in process only"):
        check_backend(f"{PACKAGE}.backends:on_a_cluster")
    with pytest.raises(ValueError, match=r"expected a fedsparse.lab.launch.backends.BackendSpec"):
        check_backend(f"{PACKAGE}:tiny_cnn")
    unknown = r"^backend='grid': expected one of flower, .*, or package.module:attribute"
    with pytest.raises(ValueError, match=unknown):
        check_backend("grid")
