"""The Docker/compose deployment runs the same Flower commands as ``run_deployment``.

``docker-compose.yml`` (plain) and ``deploy/with-tls.yml`` (TLS overlay) are parsed with
PyYAML and their commands compared, flag by flag, with
``fedsparse.lab.deploy.deployment_args``; ``docker compose config -q`` validates both
where a docker CLI with the compose plugin exists (no engine needed).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from fedsparse.lab.deploy import deployment_args

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
TLS = ROOT / "deploy" / "with-tls.yml"
HTTP_PORT, FLEET_PORT, NODE_PORT = 9093, 9092, 9094
NODES = ("supernode-0", "supernode-1")


def _services(*files: Path) -> dict[str, dict]:
    """Services after compose's override rule for ``command``/scalars (later file wins)."""
    merged: dict[str, dict] = {}
    for path in files:
        for name, service in yaml.safe_load(path.read_text())["services"].items():
            merged.setdefault(name, {}).update(service)
    return merged


#: Where the compose SuperNodes keep their privacy ledgers (a named volume each).
LEDGER_DIR = "/var/lib/fedsparse/ledger"


def _options(command: list[str]) -> dict[str, str | None]:
    """``--flag value`` pairs (``None`` for bare flags) of a command line."""
    options: dict[str, str | None] = {}
    for i, token in enumerate(command):
        if token.startswith("--"):
            following = command[i + 1] if i + 1 < len(command) else "--"
            options[token] = None if following.startswith("--") else following
    return options


def _reference() -> tuple[dict[str, str | None], list[dict[str, str | None]]]:
    superlink, supernodes = deployment_args(
        http_port=HTTP_PORT,
        fleet_port=FLEET_PORT,
        num_nodes=2,
        node_ports=[NODE_PORT] * 2,
        ledger_dirs=[LEDGER_DIR] * 2,
    )
    assert Path(superlink[0]).name == "flower-superlink"
    assert all(Path(node[0]).name == "flower-supernode" for node in supernodes)
    return _options(superlink), [_options(node) for node in supernodes]


def _compose_available() -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    probe = subprocess.run([docker, "compose", "version"], capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not _compose_available(), reason="no docker CLI with the compose plugin")
@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, TLS]], ids=["plain", "tls"])
def test_compose_config_is_valid(files: list[Path]) -> None:
    args = ["docker", "compose", "--project-directory", str(ROOT)]
    for path in files:
        args += ["-f", str(path)]
    result = subprocess.run([*args, "config", "-q"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_plain_compose_runs_the_run_deployment_commands() -> None:
    services = _services(COMPOSE)
    assert set(services) == {"superlink", *NODES}
    link_ref, node_refs = _reference()

    link = services["superlink"]["command"]
    assert link[0] == "flower-superlink"
    link_opts = _options(link)
    assert link_opts.keys() == link_ref.keys()
    # same ports; in a container the SuperLink binds all interfaces (published on 127.0.0.1)
    assert link_opts["--port"] == link_ref["--port"] == str(HTTP_PORT)
    assert link_opts["--host"] == "0.0.0.0"
    assert link_opts["--fleet-api-address"] == f"0.0.0.0:{FLEET_PORT}"
    assert set(services["superlink"]["ports"]) == {
        f"127.0.0.1:{port}:{port}" for port in (HTTP_PORT, FLEET_PORT)
    }
    assert any(volume.endswith(":/runs") for volume in services["superlink"]["volumes"])

    for name, ref in zip(NODES, node_refs, strict=True):
        command = services[name]["command"]
        assert command[0] == "flower-supernode"
        opts = _options(command)
        assert opts.keys() == ref.keys()
        assert opts["--node-config"] == ref["--node-config"]
        assert opts["--superlink"] == f"superlink:{FLEET_PORT}"
        assert opts["--host"] == ref["--host"] == "127.0.0.1"  # ClientAppIo stays local
        assert opts["--port"] == ref["--port"]
    partitions = [_options(services[n]["command"])["--node-config"] for n in NODES]
    assert partitions == [
        f"partition-id={i} num-partitions=2 ledger-dir='{LEDGER_DIR}'" for i in range(2)
    ]
    for i, name in enumerate(NODES):  # each node's ledger in its own named volume
        assert services[name]["volumes"] == [f"ledger-{i}:{LEDGER_DIR}"]


def test_tls_overlay_swaps_insecure_for_certificates() -> None:
    plain, tls = _services(COMPOSE), _services(COMPOSE, TLS)
    ssl = {"--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile"}

    link_plain, link_tls = (
        _options(plain["superlink"]["command"]),
        _options(tls["superlink"]["command"]),
    )
    assert link_tls.keys() == (link_plain.keys() - {"--insecure"}) | ssl
    assert {k: v for k, v in link_tls.items() if k not in ssl} == {
        k: v for k, v in link_plain.items() if k != "--insecure"
    }
    mounts = [volume.split(":")[1] for volume in tls["superlink"]["volumes"]]
    for flag in ssl:
        assert any(link_tls[flag].startswith(mount) for mount in mounts), flag

    for name in NODES:
        node_plain, node_tls = _options(plain[name]["command"]), _options(tls[name]["command"])
        assert node_tls.keys() == (node_plain.keys() - {"--insecure"}) | {"--root-certificates"}
        assert {k: v for k, v in node_tls.items() if k != "--root-certificates"} == {
            k: v for k, v in node_plain.items() if k != "--insecure"
        }
        targets = [volume.split(":")[1] for volume in tls[name]["volumes"]]
        assert node_tls["--root-certificates"] in targets


def test_dockerfile_installs_cpu_torch_and_runs_as_non_root() -> None:
    text = (ROOT / "deploy" / "docker" / "fedsparse" / "Dockerfile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    pin = re.search(r'"torch==([^"]+)"', pyproject)
    assert pin is not None
    assert f"ARG TORCH_VERSION={pin.group(1)}\n" in text  # the image tracks the project's pin
    assert "--index-url" in text and "download.pytorch.org/whl/cpu" in text
    assert "\nUSER app\n" in text
