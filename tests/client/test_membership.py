"""No failure of a node depends on one of its examples: the membership oracle is closed.

The attack: the server sends a crafted (finite) global model whose loss is NaN for one chosen
example only. Before the fix the non-finite per-sample gradient survived clipping and noise,
the encoder refused it, and the node replied with an error exactly when that example was in a
Poisson batch: members failed, non-members did not. Now the mechanism zeroes that example's
contribution (``common/dp/optimizer.py``), so a node holding the example replies like one without
it:
every reply is a finite update of the same size, on every engine.
"""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import Message

from fedsparse.client import train_message as client_module
from fedsparse.client.data import Holding, local_data, run_declaration
from fedsparse.common.config import FederatedConfig
from fedsparse.common.data.datasets import Split
from fedsparse.common.layout import ParamLayout
from fedsparse.common.models.classifiers import build_model
from fedsparse.lab.research.attacks import single_out
from tests.client.node_helpers import DEPLOYED, ask, grid, parse

QUERIES = 3


def _crafted(cfg: FederatedConfig, data: Split) -> tuple[torch.Tensor, int]:
    """(a finite model whose loss is NaN for exactly one example of ``data``, its index)."""
    model = build_model(cfg.model_name, seed=cfg.seed)
    target = single_out(model, data.x, data.y)
    return ParamLayout.from_module(model).flatten_module(model), target


def _ask(cfg: FederatedConfig, weights: torch.Tensor, split: Split, monkeypatch) -> Message:
    """One round-1 train instruction with ``weights`` to a deployed node holding ``split``."""
    declared = run_declaration(cfg, 0, 1)
    monkeypatch.setattr(client_module, "holding", lambda _: Holding(split, declared))
    return ask(grid(cfg, DEPLOYED), cfg, weights)


@pytest.mark.parametrize("engine", ["opacus", "func", "factored"])
def test_members_and_non_members_get_the_same_kind_of_reply(engine, monkeypatch) -> None:
    cfg = FederatedConfig(
        num_rounds=3,
        final_rate=0.5,
        target_epsilon=0.0,
        noise_multiplier=100.0,  # the attack needs no signal: sigma = 100 as in the report
        engine=engine,
        batch_size=4096,  # q = 1: one step over every example, so a member is always in it
    )
    data = local_data(cfg, 0, 1)
    weights, target = _crafted(cfg, data)
    keep = torch.ones(len(data), dtype=torch.bool)
    keep[target] = False
    without = Split(x=data.x[keep], y=data.y[keep])
    sizes = {}
    for name, split in (("member", data), ("non-member", without)):
        replies = [_ask(cfg, weights, split, monkeypatch) for _ in range(QUERIES)]
        errors = [r.error.reason for r in replies if r.has_error()]
        assert errors == [], (name, errors)
        parsed = [parse(r) for r in replies]
        for reply, update in parsed:
            assert torch.isfinite(update).all() and math.isfinite(reply.epsilon)
        sizes[name] = {len(reply.update) for reply, _ in parsed}
    assert sizes["member"] == sizes["non-member"] and len(sizes["member"]) == 1
