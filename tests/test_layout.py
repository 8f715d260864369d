"""The architecture, as import rules: math in the middle, Flower at the edges, tooling aside."""

import ast
import re
from pathlib import Path

import pytest

from fedsparse.lab.launch.backends import BACKEND_ALIASES, BACKENDS

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
        "launch_markers",
        "loop",
        "messages",
        "norm_bound",
        "round_stats",
        "round_updates",
        "run_records",
        "secagg",
        "secagg_rebuild",
        "secagg_round",
        "secagg_sparse",
        "strategy",
        "strategy_log",
        "tracking",
        "validation",
    ]
    for path in (ROOT / "server").glob("*.py"):
        assert not {"subprocess", "typer", "rich", "socket"} & _imports(path), path.name


def test_tests_mirror_the_packages() -> None:
    for package in PACKAGES:
        tests = [p for p in (ROOT / "tests" / package).glob("test_*.py")]
        assert tests, f"tests/{package}/ has no tests"


#: The built-in method names (``fedsparse.common.methods.METHOD_CLASSES``), spelled out here so
#: that the check does not trust the registry it guards.
_METHOD_NAMES = frozenset({"rs", "random-freeze", "lf", "ranked", "dpssgd", "gip", "random-k"})


def _is_method_ref(node: ast.expr) -> bool:
    """``method``, ``x.method`` or ``x.name``: what holds a method's name."""
    if isinstance(node, ast.Name):
        return node.id == "method"
    return isinstance(node, ast.Attribute) and node.attr in ("method", "name")


def _names_a_method(node: ast.expr) -> bool:
    """A built-in method's name, a collection of them, or a ``*METHODS`` constant."""
    if isinstance(node, ast.Constant):
        return node.value in _METHOD_NAMES
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_a_method(e) for e in node.elts)
    return isinstance(node, ast.Name) and node.id.endswith("METHODS")


def _method_branches(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename=where)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        if any(map(_is_method_ref, operands)) and any(map(_names_a_method, operands)):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_method_branch_outside_the_methods_package() -> None:
    """A method's behaviour lives in its class (``common/methods/``), not in ``method ==``."""
    home = ROOT / "common" / "methods"
    bad = [
        branch
        for folder in ("common", "client", "server", "lab", "benchmarks", "scripts")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if home not in path.parents
        for branch in _method_branches(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert bad == []


def test_the_method_branch_check_sees_a_branch() -> None:
    source = "if cfg.method == 'lf':\n    pass\nif m.name in ('gip', 'x'):\n    pass\n"
    source += "if cfg.method in INDEX_METHODS:\n    pass\nif model.name == 'tanh':\n    pass\n"
    source += "x = 'rs' != method\n"
    found = _method_branches(source, "sample.py")
    assert [line.split(":")[1] for line in found] == ["1", "3", "5", "9"]


#: Other vocabularies with one home each: (the names, spelled out; the attribute or variable
#: names that hold one; the package that alone may compare them).
_VOCABULARIES = {
    "mechanism": (frozenset({"dpsgd", "clipped", "noisy"}), ("mechanism",), "common/dp"),
    "engine": (
        frozenset({"opacus", "func", "factored"}),
        ("engine", "engine_name"),
        "common/dp/engines",
    ),
    "backend": (
        frozenset(BACKENDS) | frozenset(BACKEND_ALIASES),
        ("backend",),
        "lab/launch",
    ),
    "codec": (
        frozenset({"values", "coo", "delta", "bitmap", "auto", "fp32", "fp16", "bf16", "int8"})
        | {"int4", "int2", "int1"},
        ("codec", "value_dtype", "downlink_dtype"),
        "common/wire",
    ),
}


def _vocabulary_branches(source: str, where: str, names: frozenset[str], refs: tuple[str, ...]):
    def is_ref(node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in refs
        if isinstance(node, ast.Subscript):  # v["mechanism"], config["value-dtype"]
            key = node.slice
            return isinstance(key, ast.Constant) and str(key.value).replace("-", "_") in refs
        return isinstance(node, ast.Attribute) and node.attr in refs

    def is_name(node: ast.expr) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return any(is_name(e) for e in node.elts)
        return False

    return [
        f"{where}:{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(ast.parse(source, filename=where))
        if isinstance(node, ast.Compare)
        and any(map(is_ref, [node.left, *node.comparators]))
        and any(map(is_name, [node.left, *node.comparators]))
    ]


@pytest.mark.parametrize("vocabulary", sorted(_VOCABULARIES))
def test_no_mechanism_backend_or_codec_branch_outside_its_package(vocabulary: str) -> None:
    """A mechanism is asked what it does (``common/dp/mechanisms.py``), an engine for its
    ``EngineSpec`` (``common/dp/engines/__init__.py``), a backend what it
    runs (``lab/launch/backends.py``), a value dtype or codec how it rounds and encodes
    (``common/wire/value_formats.py``); names are compared in their own package only."""
    names, refs, home = _VOCABULARIES[vocabulary]
    bad = [  # the library (benchmarks drive the command line of any version, by its flags)
        branch
        for folder in PACKAGES
        for path in sorted((ROOT / folder).rglob("*.py"))
        if ROOT / home not in path.parents
        for branch in _vocabulary_branches(
            path.read_text(), str(path.relative_to(ROOT)), names, refs
        )
    ]
    assert bad == []


def test_the_vocabulary_check_sees_a_branch() -> None:
    names, refs, _ = _VOCABULARIES["mechanism"]
    source = "if cfg.mechanism == 'noisy':\n    pass\nif mechanism in ('dpsgd',):\n    pass\n"
    source += "if cfg.method == 'noisy':\n    pass\nx = v['mechanism'] != 'noisy'\n"
    found = _vocabulary_branches(source, "sample.py", names, refs)
    assert [line.split(":")[1] for line in found] == ["1", "3", "7"]


#: Modules allowed over :data:`MAX_MODULE_LINES`, each because one concept needs the room
#: (docs/explanation/architecture.md, "Module sizes", says why for each).
LONG_MODULES: dict[str, str] = {}

MAX_MODULE_LINES = 500


def _source_modules() -> list[Path]:
    return sorted(
        path
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if not path.name.endswith("_pb2.py")
    )


def test_no_module_is_over_500_lines_but_the_named_ones() -> None:
    long = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in _source_modules()
        if len(path.read_text().splitlines()) > MAX_MODULE_LINES
    }
    assert {name: n for name, n in long.items() if name not in LONG_MODULES} == {}
    assert set(LONG_MODULES) <= set(long), "a named module is short now: drop its entry"


#: ``x._name`` reads of another object's private attribute (not ``self``'s or ``cls``'s), with
#: why each is allowed: a third party's documented-enough internal, or the same class's own.
PRIVATE_READS = {
    ("client/guard.py", "actor._ray_actor_creation_function_descriptor"),  # Ray's actor class
    ("client/state.py", "tensor._version"),  # torch's in-place counter
    ("client/task_forker.py", "os._exit"),  # the forked child's exit
    ("common/aggregation/norm_bounds.py", "caps._at"),  # the same class's
    ("common/aggregation/norm_bounds.py", "each._at"),
    ("common/dp/engines/factored.py", "a._version"),  # torch's in-place counter
    ("common/dp/engines/factored.py", "output._version"),
    ("common/dp/engines/factored_layers.py", "a._version"),
    ("common/dp/engines/factored_layers.py", "nn.modules.batchnorm._BatchNorm"),  # torch's bases
    ("common/dp/engines/func.py", "nn.modules.batchnorm._BatchNorm"),
    ("common/dp/engines/func.py", "nn.modules.dropout._DropoutNd"),
    ("common/dp/engines/func.py", "nn.modules.instancenorm._InstanceNorm"),
    ("common/dp/per_sample.py", "module._loss"),  # the hooks it installed on that module
    ("common/dp/per_sample.py", "module._record"),
    ("common/dp/per_sample.py", "self._module._backward_recorded"),
    ("common/dp/per_sample.py", "self._module._take_recorded"),
}


def test_no_module_reads_another_objects_private_fields() -> None:
    """Issue "One renovation": nothing reaches into another class's private fields (the
    secure-aggregation state reads ``SecAggClient.progress``, the round of ``secure_round``
    the strategy's public API)."""
    found = set()
    for path in _source_modules():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
                continue
            if node.attr.startswith("__") or (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            ):
                continue
            found.add((str(path.relative_to(ROOT)), ast.unparse(node)))
    assert found - PRIVATE_READS == set()
    assert found >= PRIVATE_READS, "an allowed read is gone: drop its entry"


#: The folders of ``common/``, one per concept, and the helpers all of them share.
COMMON_CONCEPTS = {"aggregation", "data", "dp", "methods", "models", "training", "wire"}
COMMON_SHARED = {
    "atomic",
    "coerce",
    "finite",  # all_finite: the one-sum check of the hot paths
    "config",
    "config_keys",
    "config_values",  # the run config's value checks that import nothing heavy
    "known_warnings",
    "layout",
    "masks",
    "names",  # every name a run-config key accepts, importing nothing heavy
    "plugins",
    "seeds",
}
LAB_ROLES = {"cli", "experiments", "launch", "research", "simulation"}


def test_common_is_grouped_by_concept_and_lab_by_role() -> None:
    common = ROOT / "common"
    folders = {p.name for p in common.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in common.glob("*.py")} - {"__init__"}
    assert folders == COMMON_CONCEPTS
    assert modules <= COMMON_SHARED, sorted(modules - COMMON_SHARED)
    lab = ROOT / "lab"
    assert {p.name for p in lab.iterdir() if (p / "__init__.py").is_file()} == LAB_ROLES
    assert {p.stem for p in lab.glob("*.py")} == {"__init__"}


def test_tests_mirror_the_concepts() -> None:
    for concept in COMMON_CONCEPTS:
        assert list((ROOT / "tests" / "common" / concept).rglob("test_*.py")), concept


_HISTORY = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bissues? #?\d+\b", re.IGNORECASE)
#: The papers by their file names outside the repository (cite title and arXiv id instead).
_PAPER_FILES = re.compile(
    r"papers/|rs-random-sparsification-dpsgd|random-freeze-dpsgd\.txt|gip-gradient-index"
    r"|dpssgd-pruning-public-data|dpsgd-lf-layer-freezing"
)


def test_code_carries_no_dated_history_and_cites_papers_by_title() -> None:
    """Dates and issue numbers belong in CHANGELOG.md; papers are cited by title and arXiv id."""
    folders = ("common", "client", "server", "lab", "benchmarks", "scripts")
    bad = [
        f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}"
        for folder in folders
        for path in sorted((ROOT / folder).rglob("*.py"))
        if not path.name.endswith("_pb2.py")
        for lineno, line in enumerate(path.read_text().splitlines(), 1)
        if _HISTORY.search(line) or _PAPER_FILES.search(line)
    ]
    assert bad == []
