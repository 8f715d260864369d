"""The architecture, as import rules: math in the middle, Flower at the edges, tooling aside."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "common": "fedsparse.common",
    "client": "fedsparse.client",
    "server": "fedsparse.server",
    "lab": "fedsparse.lab",
}

#: package -> import prefixes it must never use.
FORBIDDEN = {
    "common": ("flwr", "grpc", "fedsparse.client", "fedsparse.server", "fedsparse.lab"),
    "client": ("fedsparse.server", "fedsparse.lab"),
    "server": ("fedsparse.client", "fedsparse.lab"),
    "lab": (),
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_crosses_a_layer(package: str) -> None:
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in sorted(_imports(path))
        if any(name == p or name.startswith(p + ".") for p in FORBIDDEN[package])
    ]
    assert bad == []


def test_server_holds_only_serverapp_code() -> None:
    """Operator tooling (CLI, launchers, relay, sweeps, reports) lives in lab/, not server/."""
    modules = sorted(p.stem for p in (ROOT / "server").glob("*.py"))
    assert modules == [
        "__init__",
        "app",
        "checkpoint",
        "downlink",
        "loop",
        "messages",
        "run_records",
        "strategy",
        "tracking",
        "validation",
    ]
    for path in (ROOT / "server").glob("*.py"):
        assert not {"subprocess", "typer", "rich", "socket"} & _imports(path), path.name


def test_tests_mirror_the_packages() -> None:
    for package in PACKAGES:
        tests = [p for p in (ROOT / "tests" / package).glob("test_*.py")]
        assert tests, f"tests/{package}/ has no tests"
