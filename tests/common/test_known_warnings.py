"""The silenced third-party warnings (``fedsparse.common.known_warnings``): exactly those, only
inside the block, and each one real (its source still raises it, in that text)."""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsparse.common.data import partition
from fedsparse.common.data.partition import partition_indices
from fedsparse.common.known_warnings import KNOWN_WARNINGS, KnownWarning, quiet_known_warnings

ROOT = Path(__file__).resolve().parents[2]


def _raised(fn: Callable[[], object]) -> list[str]:
    """The texts of the warnings ``fn`` raises, with every warning shown."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def _known(texts: list[str]) -> list[str]:
    return [
        t for t in texts if any(f"{k.category.__name__}: {k.message}" in t for k in KNOWN_WARNINGS)
    ]


def _quiet(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        with quiet_known_warnings():
            fn()

    return run


@pytest.mark.parametrize("known", KNOWN_WARNINGS, ids=lambda k: k.message)
def test_each_known_warning_is_ignored_inside_the_block_only(known: KnownWarning) -> None:
    def emit() -> None:
        warnings.warn(f"{known.message} (and the rest of its text)", known.category, stacklevel=1)

    assert len(_raised(emit)) == 1
    assert _raised(_quiet(emit)) == []


def test_other_warnings_still_show() -> None:
    def emit() -> None:
        warnings.warn("Secure RNG turned off", DeprecationWarning, stacklevel=1)  # other category
        warnings.warn("something new about Secure RNG turned off", UserWarning, stacklevel=1)

    assert len(_raised(_quiet(emit))) == 2


def test_the_filters_are_restored_after_the_block() -> None:
    before = list(warnings.filters)
    with quiet_known_warnings():
        first = warnings.filters[: len(KNOWN_WARNINGS)]  # the newest filters come first
        assert {(f[0], f[1].pattern, f[2]) for f in first if f[1] is not None} == {
            ("ignore", k.message, k.category) for k in KNOWN_WARNINGS
        }
    assert warnings.filters == before
    with pytest.raises(RuntimeError), quiet_known_warnings():
        raise RuntimeError("the block failed")
    assert warnings.filters == before


def test_every_entry_says_where_from_and_why() -> None:
    assert len({k.message for k in KNOWN_WARNINGS}) == len(KNOWN_WARNINGS)
    for known in KNOWN_WARNINGS:
        # the filters take the text as a pattern: plain text means what it says
        assert re.escape(known.message).replace("\\ ", " ") == known.message
        assert known.message and known.source and len(known.why) > 20


# The sources, for real: if a new release rewords a warning, these fail (and the entry must
# follow), rather than the filter silently matching nothing.


def _opacus_step() -> None:
    from opacus import PrivacyEngine

    model = nn.Linear(3, 2)
    x, y = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    module, optimizer, _ = PrivacyEngine(secure_mode=False).make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    nn.functional.cross_entropy(module(x), y).backward()  # the input needs no gradient
    optimizer.step()


def _loose_epsilon() -> None:
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    orders = [1.5, 2.0, 4.0, 8.0]
    rdp = compute_rdp(q=0.01, noise_multiplier=50.0, steps=10, orders=orders)
    get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5)


def _shards() -> None:
    labels = np.repeat(np.arange(10), 20)
    partition_indices(labels, num_partitions=4, partitioner="shard", shards_per_partition=2)


@pytest.mark.parametrize(
    ("fn", "texts"),
    [
        (_opacus_step, ("Secure RNG turned off", "Full backward hook is firing")),
        (_loose_epsilon, ("Optimal order is the largest alpha",)),
    ],
    ids=["opacus-step", "rdp-edge"],
)
def test_the_sources_raise_them_and_the_block_silences_them(
    fn: Callable[[], None], texts: tuple[str, ...]
) -> None:
    raised = _raised(fn)
    for text in texts:
        assert any(text in r for r in raised), raised
    assert _known(_raised(_quiet(fn))) == []


def test_partitioning_silences_the_pyarrow_deprecation(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _known(_raised(_shards)) == []
    monkeypatch.setattr(partition, "quiet_known_warnings", contextlib.nullcontext)
    assert any("FutureWarning: Specifying null_placement" in t for t in _raised(_shards))


def test_no_module_of_ours_writes_its_own_filter_for_them() -> None:
    found = []
    for package in ("common", "client", "server", "lab"):
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            if path.name == "known_warnings.py":
                continue
            found += [
                f"{path.relative_to(ROOT)}: {k.message}"
                for k in KNOWN_WARNINGS
                if k.message in text
            ]
    assert found == []
