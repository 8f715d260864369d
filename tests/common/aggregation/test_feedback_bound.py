"""The update-norm bound under error feedback (``feedback_contraction``, ``feedback_norm``,
``HonestClientBound(feedback_keep=d)``): driven by the real codecs and the client's own
``feed_back`` over many rounds of values that fill their bound in the shapes that grow the
residual most, the residual stays under ``E = (c V + a) / (1 - c)`` and every payload's
decoded norm under ``feedback_norm``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedsparse.client.round_reply import feed_back
from fedsparse.common.aggregation.quantized_norms import feedback_contraction, feedback_norm
from fedsparse.common.wire.payload import decode_update
from tests.client.test_error_feedback import encode_on
from tests.common.aggregation.test_norm_bounds import _client_bound

D, K, BLOCK, ROUNDS, V = 2048, 512, 64, 60, 3.0


def _values(shape: str, rng: np.random.Generator) -> torch.Tensor:
    """K values of L2 norm V: one spike a block (its block's largest, the others' step), or
    the norm spread evenly, or Gaussian."""
    if shape == "spikes":  # V split over the blocks' first values
        v = np.zeros(K)
        v[::BLOCK] = V / math.sqrt(K // BLOCK) * rng.choice([-1.0, 1.0], K // BLOCK)
        v[1::BLOCK] = 1e-3 * rng.normal(size=K // BLOCK)
    elif shape == "spike":  # the whole norm on one value
        v = np.zeros(K)
        v[rng.integers(K)] = V * rng.choice([-1.0, 1.0])
    elif shape == "even":
        v = V / math.sqrt(K) * rng.choice([-1.0, 1.0], K)
    else:
        v = rng.normal(size=K)
        v *= V / np.linalg.norm(v)
    return torch.from_numpy(v.astype(np.float32))


def _run(value_dtype: str, shape: str) -> tuple[float, float]:
    """(largest residual, largest decoded norm / feedback_norm) over ROUNDS rounds of random
    supports of K of D coordinates."""
    rng = np.random.default_rng(7)
    rounding = np.random.default_rng(8)
    residual = torch.zeros(D)
    bound = feedback_norm(V, peak=V, value_dtype=value_dtype, keep=K)  # type: ignore[arg-type]
    largest_e = worst = 0.0
    for r in range(1, ROUNDS + 1):
        support = torch.zeros(D, dtype=torch.bool)
        support[torch.from_numpy(rng.choice(D, K, replace=False))] = True
        sent = _values(shape, rng) + residual[support]
        payload = encode_on(sent, support, r, value_dtype, BLOCK, rounding)
        norm = float(decode_update(payload, expected_round=r).values.double().norm())
        worst = max(worst, norm / bound)
        feed_back(residual, support, sent, payload, server_round=r)
        largest_e = max(largest_e, float(residual.abs().max()))
    return largest_e, worst


@pytest.mark.parametrize("value_dtype", ["int4", "int8", "fp16", "bf16"])
@pytest.mark.parametrize("shape", ["spikes", "spike", "even", "gaussian"])
def test_the_residual_and_the_sent_norm_stay_under_their_bounds(
    value_dtype: str, shape: str
) -> None:
    contraction = feedback_contraction(value_dtype)  # type: ignore[arg-type]
    assert contraction is not None
    c, a = contraction
    largest_e, worst = _run(value_dtype, shape)
    assert largest_e <= (c * V + a) / (1 - c)
    assert worst <= 1.0


def test_the_int4_residual_reaches_a_share_of_its_bound() -> None:
    """One spike a block sets its step: the other values' rounding errors, fed back, reach
    0.30 of ``E = V / 6`` here (the induction is not vacuous, nor far off)."""
    largest_e, _ = _run("int4", "spikes")
    assert 0.25 * V / 6 < largest_e <= (1 + 2**-16) * V / 6


def test_dtypes_whose_error_does_not_contract_have_no_bound() -> None:
    assert feedback_contraction("int2") is None and feedback_contraction("int1") is None
    assert feedback_contraction("fp32") == (0.0, 0.0)
    with pytest.raises(ValueError, match="value_dtype='int2': its error does not contract"):
        feedback_norm(1.0, peak=1.0, value_dtype="int2", keep=10)
    with pytest.raises(ValueError, match="value_dtype='int2': its rounding error does not"):
        _client_bound(value_dtype="int2", feedback_keep=D)
    with pytest.raises(ValueError, match="feedback_keep=-1: expected >= 0"):
        _client_bound(feedback_keep=-1)
    # under error feedback the bound is feedback_norm of the sparse round's own bound and the
    # dense round's (the largest any round's values reach), each at P_fail / (rounds + 1): the
    # round's bound leans on every earlier round's
    plain = _client_bound(value_dtype="int4", value_block=BLOCK)
    fed = _client_bound(value_dtype="int4", value_block=BLOCK, feedback_keep=D, feedback_rounds=99)
    each = _client_bound(failure_probability=1e-11)
    expected = feedback_norm(
        each.bound(K), peak=each.bound(D), value_dtype="int4", keep=K, block=BLOCK
    )
    assert fed.bound(K) == pytest.approx(expected, rel=1e-12) and fed.bound(K) > plain.bound(K)
    assert each.bound(K) > _client_bound().bound(K)
    # gip / random-k: the payload carries up to d values; which clients it covers is read
    # at that size too (the residual's term grows with it)
    for sent in (None, D):
        first = fed.smallest_covered_examples(K, sent=sent)
        own = [
            fed._released(each._at(1, K, n), each._at(1, D, n), K if sent is None else sent)
            for n in (first - 1, first)
        ]
        limit = fed.bound(K, sent=sent)
        assert own[1] <= limit and (first == 1 or own[0] > limit)
