"""The container deployment runs the same Flower commands as ``run_deployment``.

``docker-compose.yml`` (TLS + SuperNode authentication) and the opt-in ``deploy/insecure.yml``
overlay are parsed with PyYAML and their commands compared, flag by flag, with
``fedsparse.lab.launch.deploy.deployment_args`` given the containers' certificate and key paths;
``docker compose config -q`` validates them where a docker CLI with the compose plugin exists
(no engine needed). ``make test-containers`` runs them for real (``scripts/test-containers.sh``).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedsparse.client.node_data import NodeData
from fedsparse.lab.launch.compose import load_compose
from fedsparse.lab.launch.compose_hosts import main as compose_hosts_main
from fedsparse.lab.launch.deploy import deployment_args
from fedsparse.lab.launch.tls import TlsFiles

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
INSECURE = ROOT / "deploy" / "insecure.yml"
GPU = ROOT / "deploy" / "gpu.yml"
DOCKERFILE = ROOT / "deploy" / "docker" / "fedsparse" / "Dockerfile"
HTTP_PORT, FLEET_PORT, NODE_PORT = 9093, 9092, 9094
#: The SuperLink's address on the control network, the only one its HTTP API listens on.
CONTROL_IP = "${FEDSPARSE_CONTROL_IP:-10.249.249.2}"
NUM_NODES = 3
NODES = tuple(f"supernode-{i}" for i in range(NUM_NODES))
#: Where the compose SuperNodes keep their privacy ledgers (a named volume each).
LEDGER_DIR = "/var/lib/fedsparse/ledger"
#: The certificate files as the SuperLink container sees them.
TLS = TlsFiles(
    ca_cert=Path("/app/certificates/ca.crt"),
    server_cert=Path("/app/certificates/server.pem"),
    server_key=Path("/app/certificates/server.key"),
)
KEYS = [Path(f"/app/keys/node-{i}") for i in range(NUM_NODES)]


def _services(*files: Path) -> dict[str, dict[str, Any]]:
    """Services after compose's override rule for ``command``/scalars/``!override``."""
    merged: dict[str, dict[str, Any]] = {}
    for path in files:
        for name, service in load_compose(path)["services"].items():
            merged.setdefault(name, {}).update(service)
    return merged


def _options(command: list[str]) -> dict[str, str | None]:
    """``--flag value`` pairs (``None`` for bare flags) of a command line."""
    options: dict[str, str | None] = {}
    for i, token in enumerate(command):
        if token.startswith("--"):
            following = command[i + 1] if i + 1 < len(command) else "--"
            options[token] = None if following.startswith("--") else following
    return options


def _reference(*, secure: bool) -> tuple[dict[str, str | None], list[dict[str, str | None]]]:
    superlink, supernodes = deployment_args(
        http_port=HTTP_PORT,
        fleet_port=FLEET_PORT,
        num_nodes=NUM_NODES,
        node_ports=[NODE_PORT] * NUM_NODES,
        tls=TLS if secure else None,
        auth_keys=KEYS if secure else None,
        ledger_dirs=[LEDGER_DIR] * NUM_NODES,
    )
    assert Path(superlink[0]).name == "flower-superlink"
    assert all(Path(node[0]).name == "fedsparse" and node[1] == "node" for node in supernodes)
    return _options(superlink), [_options(node) for node in supernodes]


def _compose_available() -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    probe = subprocess.run([docker, "compose", "version"], capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not _compose_available(), reason="no docker CLI with the compose plugin")
@pytest.mark.parametrize(
    "files", [[COMPOSE], [COMPOSE, INSECURE], [COMPOSE, GPU]], ids=["secure", "insecure", "gpu"]
)
def test_compose_config_is_valid(files: list[Path]) -> None:
    args = ["docker", "compose", "--project-directory", str(ROOT)]
    for path in files:
        args += ["-f", str(path)]
    result = subprocess.run([*args, "config", "-q"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def _podman_compose() -> Path | None:
    """``make test-containers``'s podman-compose, if it was installed here."""
    tool = ROOT / "build" / "compose-venv" / "bin" / "podman-compose"
    return tool if tool.exists() and shutil.which("podman") else None


@pytest.mark.skipif(_podman_compose() is None, reason="no podman-compose (make test-containers)")
@pytest.mark.parametrize(
    "files", [[COMPOSE], [COMPOSE, INSECURE], [COMPOSE, GPU]], ids=["secure", "insecure", "gpu"]
)
def test_podman_compose_merges_the_files(files: list[Path]) -> None:
    args = [str(_podman_compose())]
    for path in files:
        args += ["-f", str(path)]
    result = subprocess.run(
        [*args, "config"], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.returncode == 0, result.stderr
    merged = yaml.safe_load(result.stdout)["services"]
    insecure = INSECURE in files
    for service in merged.values():
        assert ("--insecure" in service["command"]) == insecure
        assert any(v.startswith("./deploy/certs/") for v in service["volumes"]) != insecure


def _check_mirrors(services: dict[str, dict[str, Any]], *, secure: bool) -> None:
    """Every command has ``deployment_args``'s flags and values, container addresses aside."""
    assert set(services) == {"superlink", *NODES}
    link_ref, node_refs = _reference(secure=secure)

    link = services["superlink"]["command"]
    assert link[0] == "flower-superlink"
    link_opts = _options(link)
    assert link_opts.keys() == link_ref.keys()
    # in a container the SuperLink's HTTP API binds its control-network address only
    assert link_opts.pop("--host") == CONTROL_IP
    assert link_opts.pop("--fleet-api-address") == f"0.0.0.0:{FLEET_PORT}"
    assert link_opts == {k: v for k, v in link_ref.items() if k in link_opts}
    assert link_opts["--port"] == str(HTTP_PORT)

    for name, ref in zip(NODES, node_refs, strict=True):
        command = services[name]["command"]
        assert command[:2] == ["fedsparse", "node"]  # only the node's own ClientApp runs
        opts, ref = _options(command), dict(ref)
        # the SuperLink's service name on the compose network instead of loopback
        assert (opts.pop("--superlink"), ref.pop("--superlink")) == (
            f"superlink:{FLEET_PORT}",
            f"127.0.0.1:{FLEET_PORT}",
        )
        assert opts == ref  # same flags, values, partition, key; ClientAppIo local
        assert ref["--host"] == "127.0.0.1"
    partitions = [_options(services[n]["command"])["--node-config"] for n in NODES]
    nominal = -(-1437 // NUM_NODES)  # the largest iid partition of digits' training split
    assert partitions == [
        f"partition-id={i} num-partitions={NUM_NODES} dataset='digits' nominal-size={nominal} "
        f"ledger-dir='{LEDGER_DIR}'"
        for i in range(NUM_NODES)
    ]


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> source of a service's volumes."""
    return {volume.split(":")[1]: volume.split(":")[0] for volume in service["volumes"]}


def test_default_compose_is_tls_with_supernode_auth() -> None:
    services = _services(COMPOSE)
    _check_mirrors(services, secure=True)
    link = _options(services["superlink"]["command"])
    assert "--insecure" not in link and "--enable-supernode-auth" in link
    assert set(services["superlink"]["ports"]) == {
        f"127.0.0.1:{HTTP_PORT}:{HTTP_PORT}",  # Control API: this host only
        f"${{FLEET_API_BIND:-127.0.0.1}}:{FLEET_PORT}:{FLEET_PORT}",
    }
    # every file a command names is mounted, one file at a time, read-only
    mounts = _mounts(services["superlink"])
    assert mounts["/runs"] == "runs"
    for flag in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile"):
        assert link[flag] in mounts, flag
    for i, name in enumerate(NODES):
        node, node_mounts = _options(services[name]["command"]), _mounts(services[name])
        assert node_mounts[LEDGER_DIR] == f"ledger-{i}"  # each node's ledger in its own volume
        assert node_mounts[str(KEYS[i])] == f"./deploy/certs/nodes/node-{i}"
        assert node["--root-certificates"] in node_mounts
    for service in services.values():
        for volume in service["volumes"]:
            source = volume.split(":")[0]
            assert "ca.key" not in source and not source.endswith(("/ca", "/certs")), volume
            if source.startswith("./"):
                assert volume.endswith(":ro"), volume


def test_no_supernode_is_on_the_network_of_the_control_api() -> None:
    """The Control API starts runs (ships code): SuperNodes share only the internal `fleet`
    network with the SuperLink, whose HTTP API listens on its `control` address alone."""
    document = load_compose(COMPOSE)
    services = document["services"]
    assert document["networks"]["fleet"] == {"internal": True}  # no route out of it
    subnet = document["networks"]["control"]["ipam"]["config"][0]["subnet"]
    assert subnet == "${FEDSPARSE_CONTROL_SUBNET:-10.249.249.0/24}"
    link = services["superlink"]
    assert link["networks"] == {"control": {"ipv4_address": CONTROL_IP}, "fleet": None}
    assert _options(link["command"])["--host"] == CONTROL_IP
    for name in NODES:
        assert services[name]["networks"] == ["fleet"]
        assert "ports" not in services[name]
    insecure = _services(COMPOSE, INSECURE)["superlink"]["command"]
    assert _options(insecure)["--host"] == CONTROL_IP


def test_insecure_overlay_is_the_explicit_opt_out() -> None:
    services = _services(COMPOSE, INSECURE)
    _check_mirrors(services, secure=False)
    for service in services.values():
        assert "--insecure" in service["command"]
        assert not any(volume.startswith("./") for volume in service["volumes"])  # no certs
    assert _mounts(services["superlink"]) == {"/runs": "runs"}


def test_gpu_overlay_reserves_gpus_for_the_supernodes() -> None:
    services = load_compose(GPU)["services"]
    assert set(services) == {"superlink", *NODES}
    want = [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    for name in NODES:
        assert services[name]["deploy"]["resources"]["reservations"]["devices"] == want
    assert "deploy" not in services["superlink"]
    for service in services.values():  # a CUDA torch build, under its own tag
        assert service["image"].endswith("-gpu")
        assert "download.pytorch.org/whl/cu" in service["build"]["args"]["TORCH_INDEX_URL"]


def test_dockerfile_pins_the_projects_torch_and_flower_and_runs_as_non_root() -> None:
    text = DOCKERFILE.read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch=="))
    assert f"ARG TORCH_VERSION={pin.removeprefix('torch==')}\n" in text
    # users get the CPU build by default; any base (python:3.11-slim or a bare Debian)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu\n" in text
    assert "ARG BASE_IMAGE=python:3.11-slim\nFROM ${BASE_IMAGE}\n" in text
    flwr = re.search(r"\nARG FLWR_VERSION=(\S+)\n", text)
    assert flwr is not None and flwr.group(1).startswith("1.39.")  # gRPC Fleet API (<1.40)
    assert flwr.group(1) == importlib.metadata.version("flwr")  # what the tests run against
    assert "\nUSER app\n" in text and "ARG APP_UID=49999\n" in text


def test_image_installs_every_package_folder() -> None:
    text = DOCKERFILE.read_text()
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    for folder in {source.split("/")[0] for source in package_dir.values()}:
        assert f"\nCOPY {folder} ./{folder}\n" in text, folder
        assert f"!{folder}/" in ignore, folder


def test_the_earlier_tls_overlay_still_works_and_changes_nothing() -> None:
    # `-f docker-compose.yml -f deploy/with-tls.yml` was the TLS command; TLS is the default now.
    overlay = yaml.safe_load((ROOT / "deploy" / "with-tls.yml").read_text())
    assert overlay == {"services": {}}


# -- across hosts: deploy/superlink-host.yml and deploy/node-host.yml ---------------------------

SUPERLINK_HOST = ROOT / "deploy" / "superlink-host.yml"
NODE_HOST = ROOT / "deploy" / "node-host.yml"
#: What the node host's variables are set to below (host A's address as its nodes dial it).
HOST_ENV = {
    "SUPERLINK_ADDRESS": "203.0.113.7:9092",
    "PARTITION_ID": "1",
    "NUM_PARTITIONS": "4",
    "NOMINAL_SIZE": "400",
}
_VARIABLE = re.compile(r"\$\{([A-Z_]+)(?::[-?][^}]*)?\}")


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR:?message}`` with ``env``."""

    def value(match: re.Match[str]) -> str:
        name, spec = match.group(1), match.group(0)
        if name in env:
            return env[name]
        if ":-" in spec:
            return spec[spec.index(":-") + 2 : -1]
        raise KeyError(f"{name} is required: {spec}")

    return _VARIABLE.sub(value, text)


@pytest.mark.parametrize(
    ("checked_in", "host"), [(SUPERLINK_HOST, "superlink"), (NODE_HOST, "node")]
)
def test_host_files_are_the_generators_output(tmp_path: Path, checked_in: Path, host: Any) -> None:
    assert compose_hosts_main(["--host", host, "--out", str(tmp_path / "out.yml")]) == 0
    assert checked_in.read_text() == (tmp_path / "out.yml").read_text(), (
        f"{checked_in.name} drifted: `python -m fedsparse.lab.launch.compose_hosts --host {host} "
        f"--out deploy/{checked_in.name}`"
    )


def test_superlink_host_is_the_superlink_of_the_one_host_file_with_its_fleet_api_published() -> (
    None
):
    [(name, service)] = load_compose(SUPERLINK_HOST)["services"].items()
    one_host = load_compose(COMPOSE)["services"]["superlink"]
    assert name == "superlink" and service["command"] == one_host["command"]
    # same flags as the deployment the two-host test runs, the Fleet API on every interface
    superlink, _ = deployment_args(
        http_port=HTTP_PORT,
        fleet_port=FLEET_PORT,
        num_nodes=1,
        node_ports=[NODE_PORT],
        tls=TLS,
        auth_keys=[KEYS[0]],
        fleet_host="0.0.0.0",
    )
    opts, ref = _options(service["command"]), _options(superlink)
    assert opts.pop("--host") == CONTROL_IP and ref.pop("--host") == "127.0.0.1"
    assert opts == ref
    assert service["ports"] == [
        f"127.0.0.1:{HTTP_PORT}:{HTTP_PORT}",  # the API that starts runs: this host only
        f"${{FLEET_API_BIND:-0.0.0.0}}:{FLEET_PORT}:{FLEET_PORT}",  # other hosts' nodes
    ]
    assert service["build"]["context"] == ".."  # relative to deploy/, the file's folder
    mounts = _mounts(service)
    assert {mounts[path] for path in (opts["--ssl-certfile"], opts["--ssl-keyfile"])} == {
        "./certs/server.pem",
        "./certs/server.key",
    }
    assert mounts[str(opts["--ssl-ca-certfile"])] == "./certs/ca.crt"
    assert not any("ca.key" in source or "nodes" in source for source in mounts.values())


def test_node_host_dials_the_configured_superlink_with_its_own_key_and_the_handed_ca() -> None:
    [(name, service)] = load_compose(NODE_HOST)["services"].items()
    assert name == "supernode"
    command = [_interpolate(arg, HOST_ENV) for arg in service["command"]]
    assert command[:2] == ["fedsparse", "node"]
    _, [reference] = deployment_args(
        http_port=HTTP_PORT,
        fleet_port=FLEET_PORT,
        num_nodes=1,
        node_ports=[NODE_PORT],
        tls=TLS,
        auth_keys=[Path("/app/keys/node")],
        superlink_hosts=["203.0.113.7"],
        ledger_dirs=[LEDGER_DIR],
        data=[NodeData(dataset="digits", partition_id=1, num_partitions=4, nominal_size=400)],
    )
    assert _options(command) == _options(reference)
    volumes = [_interpolate(volume, {}) for volume in service["volumes"]]
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in volumes}
    assert mounts == {
        LEDGER_DIR: "ledger",
        "/app/certificates/ca.crt": "./certs/ca.crt",  # CA_CERT's default, in deploy/
        "/app/keys/node": "./certs/nodes/node",  # NODE_KEY's default
    }
    assert all(v.endswith(":ro") for v in service["volumes"] if not v.startswith("ledger:"))
    for variable in ("CA_CERT", "NODE_KEY"):  # both movable
        assert any(f"${{{variable}:-" in volume for volume in service["volumes"]), variable
    for variable in HOST_ENV:  # required: no default anywhere
        others = {k: v for k, v in HOST_ENV.items() if k != variable}
        with pytest.raises(KeyError, match=variable):
            _interpolate(" ".join(service["command"]), others)
    assert "ports" not in service and "networks" not in service  # dials out, serves nothing


def _compose_cli() -> list[str] | None:
    """``docker compose`` (the plugin) or ``docker-compose`` (v1), whichever is here."""
    if _compose_available():
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


@pytest.mark.skipif(_compose_cli() is None, reason="no docker compose / docker-compose")
@pytest.mark.parametrize("path", [SUPERLINK_HOST, NODE_HOST], ids=["superlink", "node"])
def test_host_files_are_valid_compose(path: Path) -> None:
    cli = _compose_cli()
    assert cli is not None
    env = {**os.environ, **HOST_ENV}
    run = [*cli, "-f", str(path), "config", "-q"]
    result = subprocess.run(run, capture_output=True, text=True, check=False, env=env)
    assert result.returncode == 0, result.stderr
    if path == NODE_HOST:  # a required variable unset: compose refuses, naming it
        env.pop("SUPERLINK_ADDRESS")
        result = subprocess.run(run, capture_output=True, text=True, check=False, env=env)
        assert result.returncode != 0 and "HOST:9092" in result.stderr, result.stderr
