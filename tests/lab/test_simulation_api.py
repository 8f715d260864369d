"""``fedsparse.lab.simulation.simulate``: what it hands to ``run_simulation``, its one-line
errors before anything starts, and a light import. The runs themselves are the docs' examples
(``tests/test_doc_examples.py``) and the backends' own tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fedsparse.common.config import FederatedConfig
from fedsparse.lab.simulation import simulate


class _Recorder:
    """Stands in for ``run_simulation``: records its arguments, returns a marker."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> str:
        self.calls.append(kwargs)
        return "summary"


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    recorder = _Recorder()
    monkeypatch.setattr("fedsparse.lab.launch.simulate.run_simulation", recorder)
    return recorder


def test_a_mapping_and_a_config_reach_the_run_alike(tmp_path: Path, recorder: _Recorder) -> None:
    assert simulate({"num-rounds": 2, "final_rate": "0.9"}, clients=3, out=tmp_path) == "summary"
    config = FederatedConfig(num_rounds=2, final_rate=0.9)
    simulate(config, clients=3, out=tmp_path, backend="simulation", progress=False)
    mapping, typed = recorder.calls
    assert mapping["overrides"] == {"num-rounds": 2, "final_rate": "0.9"}
    assert typed["overrides"] == {"num-rounds": 2, "final-rate": 0.9}  # the changed keys only
    assert FederatedConfig.from_run_config(mapping["overrides"]) == config
    assert (mapping["backend"], typed["backend"]) == ("inprocess", "flower")  # an old name too
    assert mapping["clients"] == 3 and mapping["out"] == tmp_path
    assert mapping["console"] is None and typed["console"].quiet is True  # None: stdout


def test_out_defaults_to_the_configs_out_dir(recorder: _Recorder) -> None:
    simulate({"out-dir": "runs/here", "seed": 3}, clients=2)
    simulate(FederatedConfig(out_dir="runs/there"), clients=2)
    simulate({}, clients=2)
    simulate({"out_dir": "runs/ignored"}, clients=2, out="runs/given")
    outs = [call["out"] for call in recorder.calls]
    assert outs == [Path("runs/here"), Path("runs/there"), Path("runs/simulate")] + [
        Path("runs/given")
    ]
    assert [call["overrides"] for call in recorder.calls] == [{"seed": 3}, {}, {}, {}]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"config": {"num-round": 2}}, ValueError, "did you mean 'num-rounds'?"),
        ({"config": {"num-rounds": "two"}}, ValueError, "num-rounds='two': expected int"),
        ({"config": {"final-rate": 1.5}}, ValueError, "final-rate"),
        ({"config": {}, "backend": "rey"}, ValueError, "backend='rey': expected one of"),
        ({"config": {}, "clients": 2.5}, ValueError, "clients=2.5: expected an integer"),
        ({"config": [("num-rounds", 2)]}, TypeError, "config=list: expected a FederatedConfig"),
    ],
)
def test_errors_are_one_line_naming_the_field_before_anything_starts(
    tmp_path: Path, recorder: _Recorder, kwargs: dict[str, Any], error: type, message: str
) -> None:
    out = tmp_path / "never"
    with pytest.raises(error) as raised:
        simulate(**{"clients": 2, "out": out, **kwargs})
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert recorder.calls == [] and not out.exists()


def test_too_few_clients_is_the_runs_own_one_line_error_and_leaves_no_folder(
    tmp_path: Path,
) -> None:
    out = tmp_path / "never"
    with pytest.raises(ValueError, match=r"^clients=0: expected >= 1$"):
        simulate({}, clients=0, out=out)
    with pytest.raises(ValueError, match=r"^clients=1: below min-clients=2") as raised:
        simulate({"min-clients": 2}, clients=1, out=out)
    assert "\n" not in str(raised.value) and not out.exists()
    there = tmp_path / "there"
    (there / "rounds.jsonl").parent.mkdir()
    (there / "rounds.jsonl").write_text("{}\n")
    with pytest.raises(ValueError):
        simulate({"min-clients": 2}, clients=1, out=there)
    assert (there / "rounds.jsonl").read_text() == "{}\n"  # a folder that was there stays


def test_importing_the_api_loads_no_heavy_library() -> None:
    probe = (
        "import json, sys; from fedsparse.lab.simulation import simulate; "
        "print(json.dumps([m for m in ('torch', 'flwr', 'ray', 'opacus', 'numpy') "
        "if m in sys.modules]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(result.stdout) == []
