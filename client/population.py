"""Many clients' rounds at once: ``population_round``, ``client_round`` for a population.

``population_round(calls, model=...)`` returns, for each ``ClientCall`` (the arguments of one
``client_round``), what ``client_round`` returns for it: the same update bytes (to float32
rounding of the trained weights), the same reported numbers and accountant history. It is a
runner for the client's round, not a second mechanism: the clients whose rounds it can
vectorise (``population_error`` is None) train together, their weights stacked in one
``(clients, d)`` tensor and each DP-SGD step's per-sample gradients computed for all of them
by one ``torch.func.vmap`` over clients of ``vmap(grad(loss_i))`` over examples (where no
client clips, one batch gradient a client: ``client/population_step.py``); every other
call runs ``client_round`` itself. The reply of a vectorised client is encoded by the same code
as ``client_round``'s (``local_round.round_reply``: the round's support, the run's codec, error
feedback, the reported ε).

Each vectorised step is ``client_round``'s step, client by client (``common/dp/optimizer.py``,
RS paper Algorithm 1)::

    B_k  = Poisson batch of client k           # its own sampler stream, rate q_k = 1/ceil(N_k/b)
    g'_i = m_k * g_i                            # sparsify each per-sample gradient (k's mask)
    c_i  = min(1, C / (||g'_i|| + 1e-6))        # clip on the masked norms (not: "noisy")
    s_k  = sum_{i in B_k} c_i g'_i              # non-finite examples contribute exactly 0
    g_k  = (s_k + m_k * N(0, (sigma_k C)^2)) / floor(N_k q_k)   # k's own noise stream
    w_k  = SGD(w_k, g_k, lr, momentum)          # a fresh optimizer, as every round

with the same streams as ``make_private`` (``seeds.Stream.POISSON_SAMPLING`` and
``DP_NOISE`` of the round's train seed): the Poisson draws are Opacus's sampler's
(``torch.rand(N_k) < q_k`` per step) and the noise is drawn parameter by parameter in the
model's order, full size and then masked, as Opacus draws it. Batches of different sizes are
padded to the largest with rows labelled ``DUMMY_LABEL``, whose loss and per-sample gradient
are exactly 0, as the rows ``make_private`` pads a node's data to its nominal size with; a
client whose steps are done (fewer examples, fewer steps) leaves the stack. The accountant of
each client takes its ``(sigma, q)`` once per step, as Opacus's step hook does.

What runs per client: ``client_round`` (``population_error`` says why) for a per-step
selector (gip, random-k), secure mode (Opacus's OS-entropy generator), a σ not yet calibrated,
a device other than the CPU or CUDA, a model ``vmap`` cannot run (``func_support_error``) or no
examples.

On CUDA (``device="cuda"``, or ``"auto"`` where torch finds one) the chunk's weights, data and
steps are on the device, and each client's noise comes from a CUDA generator seeded from its
``DP_NOISE`` stream, as ``make_private`` draws it there; the Poisson draws stay on the CPU, as
Opacus's sampler's do. The trained weights come back to the CPU for ``round_reply``.

The equivalence is tested per method, mechanism and codec against ``client_round``, on the CPU
and on CUDA (``tests/client/test_population.py``).

"To float32 rounding" holds step by step; over many steps a rounding difference can tip a
kink of the model (a max-pool choosing between two nearly equal inputs), where the per-sample
gradient jumps, and the two trajectories part by more (measured once: 2e-3 of the update's
scale after 80 noisy steps of batch 6). Any two engines (``common/dp/engines``) share this.

Memory: a step holds ``clients x batch x d`` per-sample gradients of a chunk of clients, the
chunk sized to ``chunk_bytes`` (by default ``CHUNK_BYTES`` on the CPU, ``CUDA_CHUNK_BYTES`` on
a GPU).
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import weakref
from collections.abc import Iterator, Sequence

import torch
from opacus.accountants import IAccountant, create_accountant
from torch import nn

from fedsparse.client.local_round import (
    LocalTraining,
    PublicRound,
    Release,
    RoundNoise,
    RoundPrivacy,
    RoundResult,
    client_round,
    round_mask,
)
from fedsparse.client.population_step import train_chunk
from fedsparse.client.round_reply import round_reply
from fedsparse.common.data.datasets import Split
from fedsparse.common.dp.engines import is_user_engine
from fedsparse.common.dp.engines.func import func_support_error
from fedsparse.common.dp.mechanisms import mechanism_of
from fedsparse.common.layout import ParamLayout
from fedsparse.common.seeds import Stream, stream_seed
from fedsparse.common.training.configs import resolve_device
from fedsparse.common.training.local import pad_to_nominal

__all__ = [
    "CHUNK_BYTES",
    "CUDA_CHUNK_BYTES",
    "ClientCall",
    "population_error",
    "population_round",
    "population_round_settled",
    "population_rounds",
]

#: Bytes of per-sample gradients a chunk of clients may hold in one step (``chunk_bytes``).
CHUNK_BYTES = 64 * 2**20
#: The same on CUDA. The chunk's examples, batch padding and the gradients' copy come on top
#: (dpcnn on an H200: 6.3 GiB peak); workers sharing a GPU each take this: pass chunk_bytes.
CUDA_CHUNK_BYTES = 4 * 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientCall:
    """The arguments of one ``client_round`` (its ``model`` is the population's)."""

    global_flat: torch.Tensor
    examples: Split
    public: PublicRound
    privacy: RoundPrivacy
    noise: RoundNoise
    release: Release | None = None
    residual: torch.Tensor | None = None


def population_error(call: ClientCall, model: nn.Module) -> str | None:
    """Why ``call`` runs on ``client_round`` instead of the vectorised step (None: it does
    not)."""
    privacy = call.privacy.privacy
    if privacy.secure_mode:
        return "secure-mode: Opacus's OS-entropy generator draws the batches and the noise"
    if privacy.target_epsilon is not None:
        return "target-epsilon: sigma is calibrated by client_round's make_private"
    if is_user_engine(call.public.cfg.engine):
        return f"engine={call.public.cfg.engine!r}: a user's engine runs in client_round"
    if resolve_device(call.public.cfg.device).type not in ("cpu", "cuda"):
        return f"device={call.public.cfg.device!r}: the population step runs on the CPU or CUDA"
    if model not in _SUPPORT:  # a process model's layers do not change
        _SUPPORT[model] = func_support_error(model)
    error = _SUPPORT[model]
    if error is not None:
        return error
    size = call.privacy.nominal_size or len(call.examples)
    if size == 0:
        return "no examples"
    task = call.public.task
    try:
        selector = call.public.method.step_selector(
            numel=int(call.global_flat.numel()),
            keep_fraction=call.privacy.keep_fraction,
            budget=call.privacy.budget,
            seed=0,
        )
    except Exception as err:  # client_round raises it again, as it would alone
        return f"method={call.public.cfg.method!r}: {err}"
    if selector is not None:
        return f"method={call.public.cfg.method!r}: each step chooses its support"
    if task.local_epochs < 1:
        return f"local-epochs={task.local_epochs}: nothing to vectorise"
    return None


#: ``func_support_error`` of each model ``population_error`` was asked about.
_SUPPORT: weakref.WeakKeyDictionary[nn.Module, str | None] = weakref.WeakKeyDictionary()


def population_round(
    calls: Sequence[ClientCall], *, model: nn.Module, chunk_bytes: int | None = None
) -> list[RoundResult]:
    """``[client_round(c..., model=model) for c in calls]``, the vectorisable ones at once.

    Args:
        calls: the clients' rounds (any mix; the order of the results is theirs).
        model: the run's architecture (its weights are not read; ``client_round``, for the
            calls it runs, replaces them).
        chunk_bytes: the per-sample gradients one step of a chunk of clients may hold (None:
            ``CHUNK_BYTES`` for a chunk on the CPU, ``CUDA_CHUNK_BYTES`` on a GPU).

    Raises:
        Exception: the first call's failure.
    """
    results = dict(_population(calls, model=model, chunk_bytes=chunk_bytes, settle=False))
    return [results[i] for i in range(len(calls))]  # type: ignore[misc]  # no exception


def population_round_settled(
    calls: Sequence[ClientCall], *, model: nn.Module, chunk_bytes: int | None = None
) -> list[RoundResult | Exception]:
    """``population_round``, with each failing call's exception in its place (a failing
    chunk: each of its calls) and the other calls' results: one client never fails the
    others."""
    results = dict(population_rounds(calls, model=model, chunk_bytes=chunk_bytes))
    return [results[i] for i in range(len(calls))]


def population_rounds(
    calls: Sequence[ClientCall], *, model: nn.Module, chunk_bytes: int | None = None
) -> Iterator[tuple[int, RoundResult | Exception]]:
    """``population_round_settled``'s results as each is ready, ``(index in calls, result)``:
    the per-client calls first, then chunk by chunk; a chunk's clients are set up (data,
    streams, mask) when it trains, so a round holds one chunk's, not every client's."""
    return _population(calls, model=model, chunk_bytes=chunk_bytes, settle=True)


def _population(
    calls: Sequence[ClientCall], *, model: nn.Module, chunk_bytes: int | None, settle: bool
) -> Iterator[tuple[int, RoundResult | Exception]]:
    # the vectorised step's threads, as the caller has them now (not when it reads on, after
    # finishing a reply on one thread); a client's reply takes one
    threads = torch.get_num_threads()
    return _rounds(calls, model=model, chunk_bytes=chunk_bytes, settle=settle, threads=threads)


def _rounds(
    calls: Sequence[ClientCall],
    *,
    model: nn.Module,
    chunk_bytes: int | None,
    settle: bool,
    threads: int,
) -> Iterator[tuple[int, RoundResult | Exception]]:
    vectorised: list[int] = []
    layout = ParamLayout.from_module(model)
    for i, call in enumerate(calls):
        try:
            if population_error(call, model) is None:
                vectorised.append(i)
                continue
            torch.set_num_threads(threads)  # as the caller had them (not the finishing one)
            result: RoundResult | Exception = client_round(
                call.global_flat,
                call.examples,
                call.public,
                call.privacy,
                call.noise,
                model=model,
                release=call.release,
                residual=call.residual,
            )
        except Exception as err:
            if not settle:
                raise
            result = err
        yield i, result
    pending = _chunks([(i, calls[i]) for i in vectorised], layout.numel, chunk_bytes)
    while pending:
        indices = pending.pop(0)
        chunk, failed = [], []
        for i in indices:  # make_private's setup, client by client (one's error is its own)
            try:
                chunk.append(_Client.start(i, calls[i], layout))
            except Exception as err:
                if not settle:
                    raise
                failed.append((i, err))
        yield from failed
        if not chunk:
            continue
        torch.set_num_threads(threads)
        try:
            trained = train_chunk(chunk, model, layout)
        except Exception as err:
            if not settle:
                raise
            if len(chunk) == 1:
                yield chunk[0].index, err
            else:  # one client's failure is its own: each again alone, from fresh streams
                pending[:0] = [[c.index] for c in chunk]
            continue
        finally:
            torch.set_num_threads(threads)
        # a client's reply is elementwise work on one model's values: one thread, as the
        # ClientApp takes (threads waiting on a busy core cost more than they share)
        torch.set_num_threads(1)
        try:
            for client, weights in zip(chunk, trained, strict=True):
                try:
                    result = client.result(calls[client.index], weights)
                except Exception as err:
                    if not settle:
                        raise
                    result = err
                yield client.index, result
        finally:
            torch.set_num_threads(threads)


@dataclasses.dataclass(eq=False)
class _Client:
    """One vectorised client's round: its data, streams, mask and progress."""

    index: int
    x: torch.Tensor
    y: torch.Tensor
    rate: float  # the Poisson sampler's rate, 1 / ceil(N / b)
    steps_per_epoch: int
    epochs: int
    expected_batch: int
    std: float  # sigma * C (0: no noise drawn)
    max_grad_norm: float
    clips: bool
    lr: float
    momentum: float
    data_gen: torch.Generator
    noise_gen: torch.Generator
    mask: torch.Tensor | None  # bool, d (on the CPU, as round_reply takes it)
    device: torch.device  # where the client's steps run
    initial: torch.Tensor  # the round's global model, flat (d)
    accountant: IAccountant
    noise_multiplier: float
    accounted_rate: float  # the accountant's and the batch scale's q: 1 / steps_per_epoch
    epoch_loss: list[float] = dataclasses.field(default_factory=list)
    epoch_examples: list[int] = dataclasses.field(default_factory=list)

    @classmethod
    def start(cls, index: int, call: ClientCall, layout: ParamLayout) -> _Client:
        """``make_private``'s setup for ``call``: streams, padded data, rate, mask."""
        task, privacy = call.public.task, call.privacy.privacy
        seed = call.noise.train_seed(task.server_round)
        seed = seed if seed is not None else secrets.randbits(63)
        device = resolve_device(call.public.cfg.device)
        data_gen = torch.Generator().manual_seed(stream_seed(seed, Stream.POISSON_SAMPLING))
        # Noise is drawn where the gradients are (make_private): a CUDA generator on CUDA.
        noise_gen = torch.Generator(device).manual_seed(stream_seed(seed, Stream.DP_NOISE))
        x, y = call.examples.x, call.examples.y
        if call.privacy.nominal_size is not None:
            x, y = pad_to_nominal(x, y, call.privacy.nominal_size)
        size = len(x)
        batches = math.ceil(size / max(1, min(task.batch_size, size)))  # len(loader)
        rate = 1 / batches  # the sampler's (DPDataLoader's)
        steps_per_epoch = int(1 / rate)
        # Opacus charges and scales with 1 / len(its loader), which is 1 / int(1 / rate): not
        # ``rate`` where the float inverse rounds down (k = 93, 99, 105, ...)
        accounted = 1 / steps_per_epoch
        accountant = create_accountant(mechanism=privacy.accountant)
        accountant.history = list(call.privacy.history)
        sigma = privacy.noise_multiplier
        assert sigma is not None  # calibrated (population_error)
        mechanism = mechanism_of(privacy.mechanism)
        if not mechanism.noises and sigma != 0:  # the engine's own refusal, as client_round
            raise ValueError(
                f"noise_multiplier={sigma}: mechanism={privacy.mechanism!r} adds no noise, "
                "expected noise_multiplier=0"
            )
        return cls(
            index=index,
            x=x,
            y=y,
            rate=rate,
            steps_per_epoch=steps_per_epoch,
            epochs=task.local_epochs,
            expected_batch=int(size * accounted),
            accounted_rate=accounted,
            std=sigma * privacy.max_grad_norm,
            max_grad_norm=privacy.max_grad_norm,
            clips=mechanism.clips,
            lr=task.lr,
            momentum=task.momentum,
            data_gen=data_gen,
            noise_gen=noise_gen,
            mask=round_mask(call.public, layout.numel, None),
            device=device,
            initial=call.global_flat,
            accountant=accountant,
            noise_multiplier=sigma,
        )

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def sample(self) -> torch.Tensor:
        """The next Poisson batch's indices (Opacus's ``UniformWithReplacementSampler``)."""
        chosen = torch.rand(len(self.x), generator=self.data_gen) < self.rate
        return chosen.nonzero(as_tuple=False).reshape(-1)

    def noise(self, layout: ParamLayout) -> torch.Tensor:
        """The step's noise, full size, drawn parameter by parameter as Opacus draws it (the
        caller masks it)."""
        parts = [
            torch.normal(
                mean=0, std=self.std, size=shape, generator=self.noise_gen, device=self.device
            ).reshape(-1)
            for _, _, shape in layout.slices()
        ]
        return torch.cat(parts)

    def result(self, call: ClientCall, trained: torch.Tensor) -> RoundResult:
        """``client_round``'s result from the ``trained`` weights (``round_reply``)."""
        for _ in range(self.steps):  # Opacus's step hook: one accountant step per step
            self.accountant.step(
                noise_multiplier=self.noise_multiplier, sample_rate=self.accounted_rate
            )
        losses = [
            total / n if n else math.nan
            for total, n in zip(self.epoch_loss, self.epoch_examples, strict=True)
        ]
        local = LocalTraining(
            trained=trained,
            epoch_losses=losses,
            examples=sum(self.epoch_examples),
            history=list(self.accountant.history),
        )
        residual = call.residual.clone() if call.residual is not None else None
        reply = round_reply(
            call.global_flat,
            len(call.examples),
            call.public,
            call.privacy,
            call.noise,
            local,
            self.mask,
            None,
            call.release or Release(),
            residual,
        )
        return RoundResult(reply, local.history, call.privacy.index_spent, residual)


def _chunks(
    calls: list[tuple[int, ClientCall]], numel: int, chunk_bytes: int | None
) -> list[list[int]]:
    """The clients' indices in chunks whose per-sample gradients fit ``chunk_bytes`` at about
    twice their expected batch (Poisson batches vary), a chunk's inputs of one shape and dtype
    on one device."""
    chunks: list[list[int]] = []
    current: list[int] = []
    used = 0
    planned = [(_kind(call), _expected_batch(call), i) for i, call in calls]
    current_kind: tuple[object, ...] | None = None
    for kind, expected, i in sorted(planned, key=lambda p: str(p[0])):  # stable: calls' order
        if current and kind != current_kind:
            chunks.append(current)
            current, used = [], 0
        current_kind = kind
        cost = 2 * max(1, expected) * numel * 4
        limit = chunk_bytes
        if limit is None:
            limit = CUDA_CHUNK_BYTES if str(kind[3]).startswith("cuda") else CHUNK_BYTES
        if current and used + cost > limit:
            chunks.append(current)
            current, used = [], 0
        current.append(i)
        used += cost
    if current:
        chunks.append(current)
    return chunks


def _kind(call: ClientCall) -> tuple[object, ...]:
    """What a chunk's clients share: input shape and dtype, label dtype, device."""
    x, y = call.examples.x, call.examples.y
    device = resolve_device(call.public.cfg.device)
    return (tuple(x.shape[1:]), x.dtype, y.dtype, str(device))


def _expected_batch(call: ClientCall) -> int:
    """``_Client.start``'s expected batch, from the call alone (nothing set up)."""
    size = call.privacy.nominal_size or len(call.examples)
    batches = math.ceil(size / max(1, min(call.public.task.batch_size, size)))
    return int(size * (1 / int(1 / (1 / batches))))  # start's: int(size * accounted)
