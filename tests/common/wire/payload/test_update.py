"""SparseUpdate: the support and dense vector of a decoded update, and its field checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fedsparse.common.masks import derive_seed, sample_mask
from fedsparse.common.wire.payload import SparseUpdate, decode_update, encode_update
from tests.common.wire.payload.helpers import V1_VALUE_DTYPES


def test_seeded_support_is_the_public_mask() -> None:
    d, keep, seed = 300_000, 12_345, derive_seed(9, 1)
    mask = sample_mask(d, keep=keep, seed=seed)
    dense = torch.randn(d, generator=torch.Generator().manual_seed(1))
    update = decode_update(encode_update(dense[mask], dense_size=d, round=1, mask_seed=seed))
    support = update.support()
    assert support is not None and support.dtype == torch.int64
    assert torch.equal(support, torch.nonzero(mask).flatten())
    assert torch.equal(update.to_dense(), torch.where(mask, dense, torch.zeros(())))


@pytest.mark.parametrize("value_dtype", V1_VALUE_DTYPES)
def test_to_dense_places_values(value_dtype: str) -> None:
    values = torch.tensor([0.5, -1.25, 3.0])
    coo = decode_update(
        encode_update(
            values,
            dense_size=8,
            round=0,
            indices=torch.tensor([1, 4, 7]),
            encoding="coo",
            value_dtype=value_dtype,
        )
    )
    assert coo.to_dense().tolist() == [0, 0.5, 0, 0, -1.25, 0, 0, 3.0]
    dense = decode_update(encode_update(values, dense_size=3, round=0, value_dtype=value_dtype))
    assert dense.support() is None and dense.to_dense().tolist() == [0.5, -1.25, 3.0]
    seeded = decode_update(
        encode_update(values, dense_size=8, round=0, mask_seed=11, value_dtype=value_dtype)
    )
    expected = torch.zeros(8)
    expected[sample_mask(8, keep=3, seed=11)] = values
    assert torch.equal(seeded.to_dense(), expected)
    empty = decode_update(encode_update(torch.zeros(0), dense_size=8, round=0, mask_seed=3))
    assert empty.keep == 0 and torch.equal(empty.to_dense(), torch.zeros(8))


def test_sparse_update_validates_its_fields() -> None:
    ok: dict[str, Any] = {"dense_size": 4, "round": 0, "values": torch.zeros(2)}
    SparseUpdate(encoding="seeded", mask_seed=0, **ok)
    with pytest.raises(ValueError, match="mask_seed"):
        SparseUpdate(encoding="seeded", **ok)
    with pytest.raises(ValueError, match="indices"):
        SparseUpdate(encoding="coo", **ok)
    with pytest.raises(ValueError, match="values"):
        SparseUpdate(encoding="dense", **ok)
    with pytest.raises(ValueError, match="values: torch.float64"):
        SparseUpdate(encoding="seeded", mask_seed=0, **{**ok, "values": torch.zeros(2).double()})
