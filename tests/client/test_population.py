"""The population runner (``client/population.py``) gives each client what ``client_round``
gives it: the same accountant history, ε, counts and payload sizes, and the same update to
float32 rounding.

Tolerance: the vectorised step sums the same per-sample gradients in other orders (a batched
convolution, one norm over the kept coordinates instead of per-parameter norms), a few ulps a
step; measured at most 2e-6 of the update's largest value after a round on these settings.
``CLOSE`` allows 1e-4 of it, 50 times that, and far below a real difference: another noise
draw or batch moves the values by their own size. The settings keep the rounds short (a few
steps): over many noisy steps a float32 difference can tip a max-pool's choice between two
nearly equal inputs, a kink where the per-sample gradient jumps (measured once: 2e-3 after 80
steps of batch 6), as it can between any two engines.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from fedsparse.client import population_step
from fedsparse.client.data import local_data
from fedsparse.client.local_round import (
    PublicRound,
    Release,
    RoundNoise,
    RoundPrivacy,
    RoundResult,
    client_round,
)
from fedsparse.client.model_cache import process_model
from fedsparse.client.population import (
    ClientCall,
    population_error,
    population_round,
    population_round_settled,
)
from fedsparse.common.config import FederatedConfig
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.wire.payload import decode_update
from tests.client.round_helpers import cfg, first_task, weights
from tests.common.dp.engine_helpers import exact_cudnn

FIXED: dict[str, Any] = dict(target_epsilon=0.0, noise_multiplier=1.0, seed=3, schedule="constant")
#: The largest difference allowed, relative to the update's largest value (module docstring).
CLOSE = 1e-4
CLIENTS = 3
#: The thread count the comparisons run at. The vectorised step gave the same bits at one and
#: two threads; ``client_round``'s own result moves with the count by float rounding, which
#: the steps can amplify: on AVX512 kernels its update of client 1 at one thread parted from
#: its own at two by 5.7e-4 (of 0.15) in the noisy case, past ``CLOSE`` (measured). The
#: ClientApp leaves its process at one thread (``prepare_train``), so without a pin the
#: comparison would depend on which tests ran before it.
THREADS = 2


@pytest.fixture(autouse=True)
def _threads() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


def _calls(
    run: FederatedConfig,
    *,
    nominal: list[int | None] | None = None,
    residual: bool = False,
    frozen: int = 0,
    explicit: torch.Tensor | None = None,
) -> list[ClientCall]:
    """Round 1 of ``CLIENTS`` simulated clients of ``run`` (partitions 0, 1, 2)."""
    flat = weights(run)
    task = first_task(run, flat)
    calls = []
    for p in range(CLIENTS):
        method = run.make_method()
        keep_fraction, _ = method.index_charge(
            task, flat.numel(), None, 0, schedule=run.sparsity().rate_schedule(run.num_rounds)
        )
        calls.append(
            ClientCall(
                global_flat=flat,
                examples=local_data(run, p, CLIENTS),
                public=PublicRound(
                    cfg=run,
                    task=task,
                    method=method,
                    node_id=1001 + p,
                    frozen=frozen,
                    explicit=explicit,
                ),
                privacy=RoundPrivacy(
                    privacy=run.privacy(),
                    history=[(0.5, 0.25, 7)] if p == 1 else [],  # an earlier round's entry
                    index_spent=0.0,
                    nominal_size=nominal[p] if nominal else None,
                    keep_fraction=keep_fraction,
                ),
                noise=RoundNoise(seeded=True, run_seed=run.seed, partition_id=p),
                release=Release(example_count=True, train_loss=True),
                residual=torch.linspace(-0.01, 0.01, flat.numel()) if residual else None,
            )
        )
    return calls


def _alone(call: ClientCall) -> RoundResult:
    run = call.public.cfg
    return client_round(
        call.global_flat,
        call.examples,
        call.public,
        call.privacy,
        call.noise,
        model=process_model(run.model_name, run.seed).model,
        release=call.release,
        residual=call.residual,
    )


def _assert_same(got: RoundResult, ref: RoundResult, *, loss_rel: float = 1e-5) -> None:
    assert got.history == ref.history
    assert got.index_spent == ref.index_spent
    a, b = got.reply, ref.reply
    numbers = ("num_examples", "examples_seen", "epsilon", "noise_multiplier", "keep")
    assert [getattr(a, f) for f in numbers] == [getattr(b, f) for f in numbers]
    assert a.seeded_noise == b.seeded_noise
    if math.isnan(b.train_loss):  # a non-finite example's loss counts in both
        assert math.isnan(a.train_loss)
    else:
        assert a.train_loss == pytest.approx(b.train_loss, rel=loss_rel)
    assert len(a.update) == len(b.update)  # the same codec, the same sizes
    ours, theirs = decode_update(a.update), decode_update(b.update)
    assert (ours.mask_seed, ours.dense_size) == (theirs.mask_seed, theirs.dense_size)
    scale = float(theirs.values.abs().max())
    assert scale > 0
    torch.testing.assert_close(ours.values, theirs.values, rtol=0, atol=CLOSE * scale)
    if ref.residual is None:
        assert got.residual is None
    else:
        assert got.residual is not None
        torch.testing.assert_close(got.residual, ref.residual, rtol=0, atol=CLOSE * scale)


@pytest.mark.parametrize(
    "settings",
    [
        {},  # rs: dpsgd, the round's seeded mask
        dict(final_rate=0.0, momentum=0.9, local_epochs=2),  # dense, momentum, two epochs
        dict(mechanism="clipped", noise_multiplier=0.0),  # Algorithm 3: no noise
        dict(mechanism="noisy", max_grad_norm=1.0),  # Algorithm 2: no clipping
        dict(mask_scope="client", value_dtype="int4", error_feedback=True),
        dict(compression="zstd", value_dtype="int8", batch_size=16),
    ],
    ids=["rs", "dense-momentum-2-epochs", "clipped", "noisy", "client-mask-int4-ef", "int8-zstd"],
)
def test_each_client_gets_what_client_round_gives_it(settings: dict[str, Any]) -> None:
    run = cfg(**{**FIXED, **settings})
    calls = _calls(run, residual=run.error_feedback)
    model = process_model(run.model_name, run.seed).model
    assert all(population_error(call, model) is None for call in calls)
    shared = calls[0].global_flat  # every call's, as apply_downlink hands it out: read only
    writes, bits = shared._version, shared.clone()
    got = population_round(calls, model=model)
    for result, call in zip(got, calls, strict=True):
        _assert_same(result, _alone(call))
    assert all(call.global_flat is shared for call in calls)
    assert shared._version == writes and torch.equal(shared, bits)  # neither runner wrote it


@pytest.mark.parametrize("poisoned", [False, True], ids=["finite", "nan-examples"])
def test_without_clipping_a_client_sums_its_batch_gradient_and_non_finite_steps_drop_examples(
    poisoned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "noisy" clips no client: one batch gradient a client; a step whose sum is not finite
    # (NaN pixels in every 5th example of client 1) is recomputed per sample, and its
    # non-finite examples contribute 0, as client_round's do.
    run = cfg(**{**FIXED, "mechanism": "noisy", "max_grad_norm": 1.0})
    calls = _calls(run)
    if poisoned:
        data = calls[1].examples
        x = data.x.clone()
        x[::5] = math.nan
        calls[1] = dataclasses.replace(calls[1], examples=dataclasses.replace(data, x=x))
    per_sample = []
    clipped_step = population_step._clipped_step

    def counted(*args: Any) -> Any:
        per_sample.append(len(args[2]))
        return clipped_step(*args)

    monkeypatch.setattr(population_step, "_clipped_step", counted)
    got = population_round(calls, model=process_model(run.model_name, run.seed).model)
    assert bool(per_sample) == poisoned  # finite: no per-sample gradient at all
    for result, call in zip(got, calls, strict=True):
        _assert_same(result, _alone(call))
    if poisoned:
        assert all(torch.isfinite(decode_update(r.reply.update).values).all() for r in got)


def test_clients_of_other_sizes_leave_the_stack_when_their_steps_are_done() -> None:
    # 479 examples each, two padded to other nominal sizes: ceil(N / 64) steps an epoch.
    run = cfg(**FIXED, batch_size=64, local_epochs=1)
    calls = _calls(run, nominal=[None, 600, 900])
    got = population_round(calls, model=process_model(run.model_name, run.seed).model)
    assert [r.history[-1][2] for r in got] == [8, 10, 15]
    for result, call in zip(got, calls, strict=True):
        _assert_same(result, _alone(call))


def test_lfs_frozen_prefix_and_an_explicit_support() -> None:
    run = cfg(**FIXED, final_rate=0.0)
    d = weights(run).numel()
    for kwargs in (dict(frozen=d // 2), dict(explicit=torch.arange(0, d, 3))):
        calls = _calls(run, **kwargs)  # type: ignore[arg-type]
        got = population_round(calls, model=process_model(run.model_name, run.seed).model)
        for result, call in zip(got, calls, strict=True):
            _assert_same(result, _alone(call))


def test_chunks_of_one_client_give_the_same_rounds() -> None:
    run = cfg(**FIXED)
    calls = _calls(run)
    model = process_model(run.model_name, run.seed).model
    together = population_round(calls, model=model)
    apart = population_round(calls, model=model, chunk_bytes=1)
    for a, b in zip(apart, together, strict=True):
        _assert_same(a, b)


@pytest.mark.parametrize(
    "settings", [{}, dict(mechanism="noisy", momentum=0.9, local_epochs=2)], ids=["rs", "noisy"]
)
def test_clients_from_copies_of_the_model_get_the_shared_models_rounds(
    settings: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # One downlinked tensor for all: the first step runs from unstacked weights; a copy each
    # (another process's nodes, a restored state): every step from stacked rows. Both paths
    # give each client its round.
    run = cfg(**{**FIXED, **settings})
    shared = _calls(run)
    copies = [dataclasses.replace(c, global_flat=c.global_flat.clone()) for c in shared]
    grads = []
    summed_step, clipped_step = population_step._summed_step, population_step._clipped_step

    def seen(step: Any) -> Any:
        def wrapped(*args: Any) -> Any:
            grads.append(args[1]["features.0.weight"].dim())  # 5: one row a client
            return step(*args)

        return wrapped

    monkeypatch.setattr(population_step, "_summed_step", seen(summed_step))
    monkeypatch.setattr(population_step, "_clipped_step", seen(clipped_step))
    model = process_model(run.model_name, run.seed).model
    from_shared = population_round(shared, model=model)
    steps = len(grads)
    from_copies = population_round(copies, model=model)
    assert grads[0] == 4 and grads[steps] == 5  # the shared model, then a row a client
    assert set(grads[1:steps]) <= {5} and set(grads[steps:]) == {5}
    for a, b, call in zip(from_shared, from_copies, shared, strict=True):
        _assert_same(a, b)
        _assert_same(a, _alone(call))


def test_what_it_cannot_vectorise_runs_on_client_round_and_says_why() -> None:
    run = cfg(**FIXED, method="random-k", final_rate=0.9)
    calls = _calls(run)
    model = process_model(run.model_name, run.seed).model
    assert population_error(calls[0], model) == ("method='random-k': each step chooses its support")
    got = population_round(calls, model=model)
    for result, call in zip(got, calls, strict=True):
        assert result.reply == _alone(call).reply  # client_round itself: the same bytes
    secure = dataclasses.replace(
        calls[0].privacy, privacy=dataclasses.replace(run.privacy(), secure_mode=True)
    )
    plain = _calls(cfg(**FIXED))[0]
    assert "secure-mode" in str(population_error(dataclasses.replace(plain, privacy=secure), model))
    uncalibrated = dataclasses.replace(
        plain.privacy,
        privacy=dataclasses.replace(run.privacy(), target_epsilon=3.0, noise_multiplier=None),
    )
    error = population_error(dataclasses.replace(plain, privacy=uncalibrated), model)
    assert error is not None and error.startswith("target-epsilon")


def test_another_noise_stream_is_another_update() -> None:
    run = cfg(**FIXED)
    calls = _calls(run)
    model = process_model(run.model_name, run.seed).model
    moved = [
        dataclasses.replace(c, noise=RoundNoise(seeded=True, run_seed=4, partition_id=i))
        for i, c in enumerate(calls)
    ]
    a = population_round(calls, model=model)
    b = population_round(moved, model=model)
    for x, y in zip(a, b, strict=True):
        diff = decode_update(x.reply.update).values - decode_update(y.reply.update).values
        assert float(diff.abs().max()) > 100 * CLOSE * float(
            decode_update(x.reply.update).values.abs().max()
        )


def test_a_failing_client_gets_its_error_and_the_others_their_rounds() -> None:
    run = cfg(**FIXED)
    calls = _calls(run)
    model = process_model(run.model_name, run.seed).model
    broken = dataclasses.replace(
        calls[1].privacy, privacy=dataclasses.replace(run.privacy(), mechanism="clipped")
    )  # clipped with sigma 1: the engine's own refusal
    calls[1] = dataclasses.replace(calls[1], privacy=broken)
    with pytest.raises(ValueError, match="noise_multiplier=1.0: mechanism='clipped'"):
        population_round(calls, model=model)
    settled = population_round_settled(calls, model=model)
    assert isinstance(settled[1], ValueError)
    for i in (0, 2):
        result = settled[i]
        assert isinstance(result, RoundResult)
        _assert_same(result, _alone(calls[i]))


def test_the_accountant_charges_opacus_rate_where_the_float_inverse_rounds_down() -> None:
    # 594 slots in batches of 6: the sampler's rate is 1/99, but 1 / (1/99) is 98.99...,
    # so Opacus's loader has 98 batches and its accountant and batch scale take q = 1/98.
    # (Alone: over 80-98 noisy steps, a float32 difference can flip a max-pool's choice, a
    # kink where the per-sample gradient jumps; module docstring.)
    run = cfg(**FIXED, batch_size=6, local_epochs=1)
    call = _calls(run, nominal=[594, None, None])[0]
    (got,) = population_round([call], model=process_model(run.model_name, run.seed).model)
    assert got.history[-1] == (1.0, 1 / 98, 98)
    _assert_same(got, _alone(call))


def test_a_client_whose_data_breaks_the_step_fails_alone() -> None:
    run = cfg(**FIXED)
    calls = _calls(run)
    model = process_model(run.model_name, run.seed).model
    data = calls[1].examples
    bad = dataclasses.replace(data, y=torch.full_like(data.y, 10))  # no such class
    calls[1] = dataclasses.replace(calls[1], examples=bad)
    with pytest.raises(Exception):  # as client_round alone  # noqa: B017
        _alone(calls[1])
    settled = population_round_settled(calls, model=model)
    assert isinstance(settled[1], Exception)
    for i in (0, 2):  # in the same chunk, trained again alone from fresh streams
        result = settled[i]
        assert isinstance(result, RoundResult)
        _assert_same(result, _alone(calls[i]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "settings",
    [{}, dict(final_rate=0.0, momentum=0.9), dict(mask_scope="client")],
    ids=["rs", "dense-momentum", "client-mask"],
)
@pytest.mark.parametrize("engine", ["opacus", "func"])
def test_on_cuda_each_client_gets_what_client_round_gives_it_there(
    settings: dict[str, Any], engine: str
) -> None:
    # The noise of both comes from a CUDA generator seeded from the same stream; without TF32
    # the float32 convolutions agree as on the CPU (docs/gpu/README.md). One epoch, as the
    # module docstring says: on the H200, two epochs of the padded client (19 steps each)
    # tipped a max-pool's choice between any two of the three (population, Opacus, func):
    # 2.5e-3 of the update's scale for func against Opacus on CUDA, 9e-4 for the population
    # against Opacus on CUDA and 5.5e-4 on the CPU, each pair equal to 3e-7 elsewhere. At one
    # epoch the largest difference was 5.9e-5 (func against Opacus, with momentum).
    run = cfg(**{**FIXED, **settings}, device="cuda", engine=engine)
    calls = _calls(run, nominal=[None, 600, None])
    model = build_model(run.model_name, seed=run.seed)  # not the process's: it moves to CUDA
    assert all(population_error(call, model) is None for call in calls)
    with exact_cudnn():
        got = population_round(calls, model=model)
        for result, call in zip(got, calls, strict=True):
            assert result.reply.update  # bytes, from weights brought back to the CPU
            _assert_same(result, _alone(call), loss_rel=CLOSE)


def test_the_vectorised_step_takes_the_callers_threads_and_a_clients_reply_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A reply is elementwise work on one model's values: at one thread, as the ClientApp
    # takes; threads waiting on a busy core cost more than they share (a sweep's jobs).
    from fedsparse.client import population

    seen: dict[str, list[int]] = {"step": [], "reply": []}
    step, reply = population_step.train_chunk, population.round_reply

    def counted_step(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen["step"].append(torch.get_num_threads())
        return step(*args, **kwargs)

    def counted_reply(*args: Any, **kwargs: Any) -> Any:
        seen["reply"].append(torch.get_num_threads())
        return reply(*args, **kwargs)

    monkeypatch.setattr(population, "train_chunk", counted_step)
    monkeypatch.setattr(population, "round_reply", counted_reply)
    run = cfg(**FIXED)
    calls = _calls(run)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = population_round(calls, model=process_model(run.model_name, run.seed).model)
        assert torch.get_num_threads() == 2  # the caller's, given back
    finally:
        torch.set_num_threads(before)
    assert seen == {"step": [2], "reply": [1] * CLIENTS}
    for result, call in zip(got, calls, strict=True):
        _assert_same(result, _alone(call))


def test_a_failing_round_gives_the_caller_its_threads_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fedsparse.client import population

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a reply failed")

    run = cfg(**FIXED)
    calls = _calls(run)
    model = process_model(run.model_name, run.seed).model
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(population, "round_reply", broken)
        with pytest.raises(RuntimeError, match="a reply failed"):
            population_round(calls, model=model)
        assert torch.get_num_threads() == 2
        monkeypatch.setattr(population, "train_chunk", broken)
        with pytest.raises(RuntimeError, match="a reply failed"):
            population_round(calls, model=model)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
