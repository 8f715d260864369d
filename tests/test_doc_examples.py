"""The Python examples of the README and the docs run, so that they cannot rot.

Which blocks run, and how:

* every ```` ```python ```` block of ``README.md`` and ``docs/**/*.md``, page by page, in the
  page's order, in one namespace per page (a later block may use what an earlier one
  defined), with a fresh temporary folder as the working directory (a relative ``out`` lands
  there);
* a block is a **fragment**, shown to be read rather than run, when its code holds the
  placeholder ``...`` (Python's Ellipsis: a line ``...``, an argument ``f(x, ...)``; not the
  text ``...`` in a string or comment). A fragment is skipped, and so is every later block of
  its page, which builds on the fragment's names;
* a block shown on two pages (the README's "In Python" is the tutorial's) runs once, on the
  first page that shows it;
* a page whose block reads a file that a command shown just before it writes (``fedsparse
  export ... --out model.pt``) gets that file, before its blocks run, from the code that
  command runs (``SETUP``).

The examples are small (2 rounds of 3 clients on the embedded digits), so this stays within
seconds.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Block:
    """A ```` ```python ```` block: its page, the line its code starts on, its code."""

    page: Path
    line: int
    code: str

    @property
    def is_fragment(self) -> bool:
        tree = ast.parse(self.code)
        return any(
            isinstance(node, ast.Constant) and node.value is Ellipsis for node in ast.walk(tree)
        )


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(path: Path) -> list[Block]:
    """The ```` ```python ```` blocks of the page at ``path``, in order."""
    text = path.read_text()
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        line = text.count("\n", 0, match.start(1)) + 1
        blocks.append(Block(path, line, match.group(1)))
    return blocks


def runnable(blocks: list[Block], *, seen: set[str]) -> list[Block]:
    """``blocks`` up to the first fragment, without those whose code is in ``seen`` (which
    takes in the code of those returned)."""
    out = []
    for block in blocks:
        if block.is_fragment:
            break
        if block.code not in seen:
            seen.add(block.code)
            out.append(block)
    return out


def _runnable_by_page() -> dict[str, list[Block]]:
    seen: set[str] = set()
    by_page = {}
    for path in _pages():
        blocks = runnable(python_blocks(path), seen=seen)
        if blocks:
            by_page[str(path.relative_to(ROOT))] = blocks
    return by_page


def _exported_model(folder: Path) -> None:
    """``fedsparse export runs/tracked --out model.pt`` of a run that trained the digits CNN."""
    from fedsparse.common.models.classifiers import build_model
    from fedsparse.lab.experiments.export import export_model, save_trained

    save_trained(build_model("digits-cnn", num_classes=10, seed=0), "digits-cnn", folder / "run")
    export_model(folder / "run", folder / "model.pt")


#: What a page's blocks need in the working directory before they run, by page.
SETUP: dict[str, Callable[[Path], None]] = {
    "docs/how-to/track-and-export.md": _exported_model,
}

RUNNABLE = _runnable_by_page()


@pytest.mark.parametrize("page", sorted(RUNNABLE))
def test_the_pages_python_examples_run(
    page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    if page in SETUP:
        SETUP[page](tmp_path)
    scope: dict[str, object] = {"__name__": f"doc_example_{Path(page).stem}"}
    for block in RUNNABLE[page]:
        source = "\n" * (block.line - 1) + block.code  # tracebacks name the page's line
        exec(compile(source, str(block.page), "exec"), scope)  # noqa: S102
    if page == "README.md":  # the federation ran and wrote what it says
        summary = scope["summary"]
        assert summary.rounds == 2  # type: ignore[attr-defined]
        assert summary.epsilon_max <= 3.0 + 1e-6  # type: ignore[attr-defined]
        assert summary.uplink_savings > 1.0  # type: ignore[attr-defined]
        assert (tmp_path / "runs" / "python" / "summary.json").is_file()


def test_the_readme_and_the_tutorial_show_the_same_runnable_federation() -> None:
    (readme,) = python_blocks(ROOT / "README.md")
    tutorial = python_blocks(ROOT / "docs" / "tutorial" / "first-federation.md")
    assert [b.code for b in tutorial] == [readme.code]
    assert not readme.is_fragment and "simulate(" in readme.code
    assert RUNNABLE["README.md"] == [readme]


def test_every_page_with_examples_runs_some_of_them_or_says_why_not() -> None:
    """Skipping is by the documented rule only: a page's blocks run up to its first fragment,
    and the pages known to hold only fragments are these."""
    only_fragments = {
        str(path.relative_to(ROOT))
        for path in _pages()
        if (blocks := python_blocks(path)) and blocks[0].is_fragment
    }
    assert only_fragments == {"docs/how-to/engine-in-your-loop.md"}
    assert set(SETUP) <= set(RUNNABLE)
    assert len([b for blocks in RUNNABLE.values() for b in blocks]) >= 4


def test_the_fragment_rule_reads_code_not_text(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 1  # ...\ny = '...'\n```\n\n```python\nf(x, ...)\n```\n\n"
        "```python\nz = x\n```\n"
    )
    first, second, third = python_blocks(page)
    assert (first.line, second.line, third.line) == (2, 7, 11)
    assert [b.is_fragment for b in (first, second, third)] == [False, True, False]
    seen: set[str] = set()
    assert runnable([first, second, third], seen=seen) == [first]  # up to the fragment
    assert runnable([first, third], seen=seen) == [third]  # first's code shown once already
