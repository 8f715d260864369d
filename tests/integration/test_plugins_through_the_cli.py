"""A user's method, model and dataset, from a package outside the repository, run federated by
the real command line: ``fedsparse simulate --set method=... --set model=... --set dataset=...``
and the method's own key by ``--set`` too, on Flower's simulation engine.

The package (``tests/plugin_package.py``) is written into ``tmp_path`` and reaches every
process of the run (the command, the SuperLink, the ServerApp and the simulated ClientApps)
through ``PYTHONPATH``, the way a lab's own package would be installed beside fedsparse.

How a simulation user allows the plug-ins: nothing to do. A node imports a plug-in only if its
node policy lists it (``plugin-methods``, ``plugin-models``; ``client/node_policy.py:
check_plugins``), except a simulated node: ``fedsparse simulate`` gives its nodes
``SIMULATION_NODE_POLICY`` (``lab/launch/flower.py``, ``noise="seeded"``: the run is the
experimenter's own), and such a node imports any plug-in the run config names. A deployed node
(``fedsparse node``) must list them.

The method's own key (``stride``) is not one that ``[tool.flwr.app.config]`` declares, and
``flwr run --run-config`` refuses such keys, so ``--set stride=3`` travels in the one declared
key that carries a plug-in's keys, ``method-options`` (``lab/cli/utils.py:
carry_method_options``). Its effect is exact: the server sends every third coordinate each
round and each reply carries those only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plugin_package import PACKAGE, write_user_package

FEDSPARSE = Path(sys.executable).parent / "fedsparse"


@pytest.mark.slow
def test_a_user_method_model_and_dataset_run_federated_through_set(tmp_path: Path) -> None:
    site = write_user_package(tmp_path / "site")  # outside the repository
    out = tmp_path / "run"
    sets = {
        "method": f"{PACKAGE}.even:EvenCoordinates",
        "stride": "3",  # the method's own key (its default is 2)
        "model": f"{PACKAGE}:tiny_cnn",
        "dataset": f"{PACKAGE}:more_stripes",
        "num-rounds": "2",
        "target-epsilon": "0",
        "noise-multiplier": "0.5",
        "lr": "0.5",
        "seed": "3",
    }
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH", "")]))
    args = [str(FEDSPARSE), "simulate", "--out", str(out), "--clients", "2", "--timeout", "300"]
    result = subprocess.run(
        [*args, *(a for key, value in sets.items() for a in ("--set", f"{key}={value}"))],
        env={**os.environ, "PYTHONPATH": path},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    config = summary["config"]
    assert config["method"] == sets["method"] and config["method-options"] == "stride=3"
    assert (config["model"], config["dataset"]) == (sets["model"], sets["dataset"])
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    d = (1 * 4 * 3 * 3 + 4) + (4 * 6 * 6 * 10 + 10)  # tiny_cnn's parameters, 10 outputs
    # stride 3, not the default 2: the option reached the server and both clients
    assert [r["keep"] for r in rounds] == [len(range(0, d, 3))] * 2
    assert [r["rate"] for r in rounds] == [1 - len(range(0, d, 3)) / d] * 2
    assert [(r["num_accepted"], r["num_rejected"]) for r in rounds] == [(2, 0)] * 2
    assert rounds[0]["dense_uplink_bytes"] == 2 * 4 * d  # the user's model: 4 d bytes a client
