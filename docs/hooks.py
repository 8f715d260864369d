"""MkDocs hook: the import tree mkdocstrings reads the Python API from.

The packages are installed under one namespace, ``fedsparse.*``, mapped onto the top-level
folders (``package-dir`` in ``pyproject.toml``), which a static reader cannot follow; as
``make typecheck`` does for mypy, ``build/api/fedsparse/<package>`` links each folder under
its import name (mkdocs.yml: ``paths: [build/api]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PACKAGES = ("common", "client", "server", "lab")
ROOT = Path(__file__).resolve().parents[1]


def on_startup(**_: Any) -> None:
    """Before any plugin's ``on_config``: mkdocstrings keeps only search paths that exist."""
    tree = ROOT / "build" / "api" / "fedsparse"
    tree.mkdir(parents=True, exist_ok=True)
    for package in PACKAGES:
        link = tree / package
        if not link.is_symlink():
            link.symlink_to(ROOT / package, target_is_directory=True)
