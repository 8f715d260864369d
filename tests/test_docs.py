"""The docs site and the README: generated reference pages equal to the code, every key
documented with a meaning, every command shown runs against the real CLI, a short README."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shlex
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from fedsparse.client.node_data import DATA_KEYS, NodeData
from fedsparse.client.node_policy import NodePolicy
from fedsparse.common.config import FederatedConfig, run_config_fields

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _generator()


def _keys(cls: type) -> set[str]:
    return {f.name.replace("_", "-") for f in dataclasses.fields(cls)}


def test_reference_pages_equal_what_the_code_generates() -> None:
    for name, text in gen.pages().items():
        assert (DOCS / "reference" / name).read_text() == text, (
            f"docs/reference/{name} is stale: run .venv/bin/python docs/gen_reference.py"
        )
    assert gen.main(["--check"]) == 0


def test_every_run_config_key_is_documented_with_type_default_and_meaning() -> None:
    rows = gen.run_config_rows()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = pyproject["tool"]["flwr"]["app"]["config"]
    documented = [row["key"] for row in rows]
    assert len(documented) == len(set(documented))
    assert set(documented) == set(declared)
    assert set(documented) == {f.name.replace("_", "-") for f in run_config_fields()}
    for row in rows:
        assert row["meaning"].strip(), f"{row['key']}: no meaning"
        assert row["type"] and row["section"], row["key"]
        # the default shown is the one pyproject.toml declares (and the dataclass's)
        assert row["default"] == gen.toml_value(declared[row["key"]]), row["key"]
    page = (DOCS / "reference" / "run-config.md").read_text()
    for key in declared:
        assert f"| `{key}` |" in page


def test_every_table_meaning_is_used_by_a_key_that_exists() -> None:
    assert set(gen.MEANINGS) <= _keys(FederatedConfig)
    assert set(gen.SECTIONS) <= _keys(FederatedConfig)
    assert set(gen.NODE_MEANINGS) <= _keys(NodeData)


@pytest.mark.parametrize(
    ("module", "cls", "page"),
    [(gen.node_policy, NodePolicy, "node-policy.md"), (gen.node_data, NodeData, "node-data.md")],
)
def test_every_node_key_is_documented_with_a_meaning(
    module: ModuleType, cls: type, page: str
) -> None:
    rows = gen.node_rows(module, cls)
    assert {row["key"] for row in rows} == _keys(cls)
    for row in rows:
        assert row["meaning"].strip(), f"{row['key']}: no meaning"
    text = (DOCS / "reference" / page).read_text()
    assert all(f"| `{key}` |" in text for key in _keys(cls))


def test_node_data_keys_are_the_declaration_keys() -> None:
    assert _keys(NodeData) == DATA_KEYS


def test_a_docstring_table_row_that_reads_on_is_joined() -> None:
    table = gen.docstring_table(gen.node_policy)
    default, meaning = table["ledger-dir"]
    assert default == '"~/.local/state/fedsparse"'
    assert meaning.endswith("(the budget then spans one run only)")


def _markdown_files() -> list[Path]:
    extra = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "deploy" / "README.md"]
    return [*extra, *sorted(DOCS.rglob("*.md"))]


def _nav_pages(nav: object) -> set[str]:
    if isinstance(nav, str):
        return {nav} if nav.endswith(".md") else set()
    if isinstance(nav, list):
        return set().union(*(_nav_pages(item) for item in nav))
    if isinstance(nav, dict):
        return set().union(*(_nav_pages(item) for item in nav.values()))
    return set()


def test_every_docs_page_is_in_the_nav() -> None:
    config = yaml.safe_load(
        "\n".join(
            line
            for line in (ROOT / "mkdocs.yml").read_text().splitlines()
            if "!!python" not in line
        )
    )
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert _nav_pages(config["nav"]) == pages


def _shell_commands() -> list[tuple[Path, list[str]]]:
    """Every command line in a bash/console code block of the README and the docs."""
    commands = []
    for path in _markdown_files():
        text = path.read_text()
        for block in re.findall(r"```(?:bash|console|sh)\n(.*?)```", text, flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" # ")[0].strip().removeprefix("$ ")
                if line and not line.startswith("#"):
                    commands.append((path, shlex.split(line, comments=True)))
    return commands


def _inline_commands() -> list[tuple[Path, list[str]]]:
    """Every `fedsparse ...` code span in the prose, but for placeholders (COMMAND, a|b)."""
    commands = []
    for path in _markdown_files():
        for span in re.findall(r"`((?:\.venv/bin/)?fedsparse [^`]+)`", path.read_text()):
            if not re.search(r"[<|]|COMMAND", span):
                commands.append((path, shlex.split(span)))
    return commands


def test_every_fedsparse_command_in_the_docs_exists_with_its_options() -> None:
    import click
    import typer.main

    from fedsparse.lab.cli import app

    group = typer.main.get_command(app)
    assert isinstance(group, click.Group)
    seen = 0
    for path, argv in [*_shell_commands(), *_inline_commands()]:
        for i, word in enumerate(argv):
            if Path(word).name != "fedsparse" or i + 1 >= len(argv):
                continue
            args = argv[i + 1 :]
            if args[0] == "--debug":
                args = args[1:]
            if args[0] in ("...", "--help"):
                continue
            name = args[0]
            assert name in group.commands, f"{path.name}: fedsparse {name}: no such command"
            command = group.commands[name]
            options = {opt for p in command.params for opt in getattr(p, "opts", [])}
            options |= {opt for p in command.params for opt in getattr(p, "secondary_opts", [])}
            for arg in args[1:]:
                flag = arg.split("=")[0]
                if flag.startswith("--") and name != "node":  # node passes flower-supernode's
                    assert flag in options, f"{path.name}: fedsparse {name} {flag}: no such option"
            seen += 1
    assert seen >= 40


def test_every_make_target_in_the_docs_exists() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+):", makefile, flags=re.M))
    for path, argv in _shell_commands():
        if argv[:1] == ["make"]:
            for target in argv[1:]:
                assert target in targets, f"{path.name}: make {target}: no such target"


def test_readme_is_short_and_leads_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S)
    assert first_block
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["make demo", "make test"]
    assert "pip install -e ." in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\nmake test\n" in ci


def test_no_document_points_outside_the_repository() -> None:
    for path in _markdown_files():
        text = path.read_text()
        assert "../shared" not in text, path
        for target in re.findall(r"\]\(([^)#]+)", text):
            if "://" in target:
                continue
            resolved = (path.parent / target).resolve()
            assert resolved.is_relative_to(ROOT), f"{path.name}: {target}"
            assert resolved.exists(), f"{path.name}: {target}"


def test_make_test_builds_the_docs_strictly() -> None:
    """`make test` depends on the strict build; --quiet would hide the warnings --strict counts
    (mkdocs 1.6: a broken link then passes)."""
    makefile = (ROOT / "Makefile").read_text()
    (test_deps,) = re.findall(r"^test:(.*)$", makefile, flags=re.M)
    assert "docs-build" in test_deps.split()
    (recipe,) = re.findall(r"^docs-build:.*\n\t(.*)$", makefile, flags=re.M)
    assert "mkdocs build --strict" in recipe
    assert "--quiet" not in recipe and " -q" not in recipe
    config = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^strict: true$", config, flags=re.M)
