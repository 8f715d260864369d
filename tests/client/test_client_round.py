"""The client's round is one Flower-free function (``client/local_round.py: client_round``):
called with the ClientApp's inputs it gives the ClientApp's bytes, and importing it loads no
Flower, gRPC or Ray."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest

from fedsparse.client.data import local_data
from fedsparse.client.local_round import (
    PublicRound,
    Release,
    RoundNoise,
    RoundPrivacy,
    client_round,
)
from fedsparse.client.model_cache import process_model
from fedsparse.client.node_policy import SIMULATION_NODE_POLICY
from fedsparse.common.masks import keep_count
from fedsparse.server.messages import train_message
from tests.client.node_helpers import NODE, cfg, first_task, grid, parse, weights

FIXED: dict[str, Any] = dict(target_epsilon=0.0, noise_multiplier=1.0, seed=3)


def test_importing_the_round_loads_no_flower_grpc_or_ray() -> None:
    code = (
        "import sys, fedsparse.client.local_round\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'flwr', 'grpc', 'ray'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(
    "settings",
    [
        {},  # rs: the round's seeded mask
        dict(mask_scope="client", value_dtype="int4"),  # the node's own mask, seeded rounding
        dict(method="random-k", final_rate=0.9),  # a per-step selector
    ],
    ids=["rs", "client-mask-int4", "random-k"],
)
def test_the_function_gives_the_client_apps_bytes(settings: dict[str, Any]) -> None:
    run = cfg(**{**FIXED, "schedule": "constant", **settings})
    flat = weights(run)
    task = first_task(run, flat)
    # The ClientApp, through an in-process grid (a simulated node: seeded noise).
    node = grid(run, SIMULATION_NODE_POLICY)
    (message,) = node.send_and_receive([train_message(task, node=NODE)])
    reply, _ = parse(message)
    # The function alone, with the same public inputs, privacy parameters and noise source.
    method = run.make_method()
    keep_fraction, _ = method.index_charge(
        task, flat.numel(), None, 0, schedule=run.sparsity().rate_schedule(run.num_rounds)
    )

    def round_with(seed: int, release: Release | None = None):
        return client_round(
            flat,
            local_data(run, 0, 1),
            PublicRound(cfg=run, task=task, method=method, node_id=NODE),
            RoundPrivacy(
                privacy=run.privacy(),
                history=[],
                index_spent=0.0,
                nominal_size=None,
                keep_fraction=keep_fraction,
            ),
            RoundNoise(seeded=True, run_seed=seed, partition_id=0),
            model=process_model(run.model_name, run.seed).model,
            release=release,
        )

    result = round_with(run.seed, Release(example_count=True, train_loss=True))
    if run.method == "rs":  # the round's mask; random-k: the union of its steps' supports
        assert reply.keep == keep_count(flat.numel(), rate=run.final_rate)
    assert result.reply.update == reply.update  # the same bytes
    assert result.reply == reply  # and the same reported numbers
    assert [entry[0] for entry in result.history] == [1.0]  # sigma, one entry for the round
    # Another noise source is another update: the noise comes from it.
    other = round_with(run.seed + 1)
    assert other.reply.update != reply.update
    assert other.reply.num_examples == 1 and other.reply.examples_seen == 0  # nothing released


def test_the_reported_train_loss_is_numpys_nanmean_bit_for_bit() -> None:
    import random
    import warnings

    import numpy as np

    from fedsparse.client.round_reply import _nanmean

    rng = random.Random(0)
    for _ in range(20_000):
        losses = [
            rng.choice([math.nan, -0.0, 0.0, rng.uniform(0, 5), rng.expovariate(1) * 1e-3])
            for _ in range(rng.randint(1, 12))
        ]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all NaN: numpy warns
            want = float(np.nanmean(losses))
        got = _nanmean(losses)
        assert (math.isnan(got) and math.isnan(want)) or got.hex() == want.hex(), losses
    narrow = [np.float32(0.1), np.float32(0.2), np.float32(0.7)]  # numpy's float32 mean
    assert _nanmean(narrow) == float(np.nanmean(narrow)) != sum(map(float, narrow)) / 3
