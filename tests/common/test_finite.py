"""Tests for fedsparse.common.finite: the one-sum finiteness check is exact."""

from __future__ import annotations

import pytest
import torch

from fedsparse.common.finite import all_finite


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 17, 38_281])
def test_one_bad_value_anywhere_is_found(dtype: torch.dtype, bad: float, where: int) -> None:
    values = torch.randn(38_282, generator=torch.Generator().manual_seed(where)).to(dtype)
    assert all_finite(values)
    values[where] = bad
    assert not all_finite(values)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_opposite_infinities_and_overflowing_finite_sums(dtype: torch.dtype) -> None:
    assert not all_finite(torch.tensor([float("inf"), float("-inf"), 1.0], dtype=dtype))
    big = torch.finfo(dtype).max
    overflowing = torch.full((8,), big, dtype=dtype)  # its own dtype's sum is inf, no term is
    assert not bool(torch.isfinite(overflowing.sum()))
    assert all_finite(overflowing)
    overflowing[3] = float("nan")
    assert not all_finite(overflowing)


def test_integer_and_complex_tensors_take_the_element_check() -> None:
    assert all_finite(torch.arange(10))
    assert all_finite(torch.tensor([1 + 2j, 3 - 1j]))
    assert not all_finite(torch.tensor([1 + 2j, complex(float("inf"), 0.0)]))


def test_empty_and_multidimensional() -> None:
    assert all_finite(torch.empty(0))
    grid = torch.zeros(3, 4, 5)
    assert all_finite(grid)
    grid[2, 1, 3] = float("inf")
    assert not all_finite(grid)
