"""A dataset for population benchmarks: as many digits-shaped examples as the population needs.

The embedded digits (1,797 images) cannot give 10,000 virtual clients an example each, and no
larger dataset is embedded. This loader draws a SYNTHETIC set of ``1 x 8 x 8`` images, class
``c`` being digits' class-``c`` mean image (the embedded digits, normalized as ``digits`` is)
plus independent N(0, 1) pixel noise: learnable, so a benchmark's accuracy still moves, but
not a result about any real dataset. Its size is ``FEDSPARSE_BENCH_EXAMPLES`` (default 20,000
training examples, a tenth as many test examples), read where it is loaded, in every process
that loads it (a Ray worker inherits the driver's environment).

Named in a run config as ``dataset=population_data:load`` with ``benchmarks/`` on
``PYTHONPATH`` (``benchmarks/ray_population.py --dataset synthetic`` does both).
"""

from __future__ import annotations

import os

import torch

from fedsparse.common.data.datasets import Split, load_dataset

__all__ = ["load"]

EXAMPLES_ENV = "FEDSPARSE_BENCH_EXAMPLES"


def load(*, data_dir: object = None, seed: int = 0) -> tuple[Split, Split]:
    """``(train, test)``: ``FEDSPARSE_BENCH_EXAMPLES`` training examples and a tenth as many."""
    del data_dir
    text = os.environ.get(EXAMPLES_ENV, "20000")
    try:
        examples = int(text)
    except ValueError:
        raise ValueError(f"{EXAMPLES_ENV}: expected an integer, got {text!r}") from None
    if examples < 10:
        raise ValueError(f"{EXAMPLES_ENV}: expected at least 10 examples, got {examples}")
    train, _ = load_dataset("digits", seed=seed)
    means = torch.stack([train.x[train.y == c].mean(0) for c in range(10)])
    generator = torch.Generator().manual_seed(seed)

    def draw(n: int) -> Split:
        y = torch.randint(0, 10, (n,), generator=generator)
        x = means[y] + torch.randn((n, 1, 8, 8), generator=generator)
        return Split(x=x.float(), y=y)

    return draw(examples), draw(max(10, examples // 10))
