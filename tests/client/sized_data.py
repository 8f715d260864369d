"""A node's own dataset loader for the count tests: the first ``n`` of digits' training
examples, ``n`` read from the declared folder's name (``data-dir=.../n-205``)."""

from __future__ import annotations

from pathlib import Path

from fedsparse.common.data.datasets import Split, load_dataset

#: The run config's and the nodes' ``dataset``.
REFERENCE = "tests.client.sized_data:load"


def load(*, data_dir: Path | None, seed: int) -> tuple[Split, Split]:
    """(the first ``n`` training examples, digits' test split)."""
    if data_dir is None:
        raise ValueError("sized_data: data-dir names the count (n-205)")
    count = int(Path(data_dir).name.removeprefix("n-"))
    train, test = load_dataset("digits", seed=seed)
    return Split(x=train.x[:count], y=train.y[:count]), test


def declared_folder(root: Path, count: int) -> str:
    """The ``data-dir`` that declares ``count`` examples."""
    return str(root / f"n-{count}")
