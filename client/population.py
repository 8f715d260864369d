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
from collections.abc import Sequence

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
    results = _population(calls, model=model, chunk_bytes=chunk_bytes, settle=False)
    return [r for r in results if isinstance(r, RoundResult)]


def population_round_settled(
    calls: Sequence[ClientCall], *, model: nn.Module, chunk_bytes: int | None = None
) -> list[RoundResult | Exception]:
    """``population_round``, with each failing call's exception in its place (a failing
    chunk: each of its calls) and the other calls' results: one client never fails the
    others."""
    return _population(calls, model=model, chunk_bytes=chunk_bytes, settle=True)


def _population(
    calls: Sequence[ClientCall], *, model: nn.Module, chunk_bytes: int | None, settle: bool
) -> list[RoundResult | Exception]:
    return_exceptions = settle
    results: list[RoundResult | Exception | None] = [None] * len(calls)
    clients: list[_Client] = []
    layout = ParamLayout.from_module(model)
    for i, call in enumerate(calls):
        try:
            if population_error(call, model) is None:
                clients.append(_Client.start(i, call, layout))
                continue
            results[i] = client_round(
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
            if not return_exceptions:
                raise
            results[i] = err
    pending = _chunks(clients, layout.numel, chunk_bytes)
    threads = torch.get_num_threads()  # the vectorised step's; a client's reply takes one
    try:
        while pending:
            chunk = pending.pop(0)
            torch.set_num_threads(threads)
            try:
                trained = train_chunk(chunk, model, layout)
            except Exception as err:
                if not return_exceptions:
                    raise
                if len(chunk) == 1:
                    results[chunk[0].index] = err
                else:  # one client's failure is its own: each again alone, from fresh streams
                    pending[:0] = [[_Client.start(c.index, calls[c.index], layout)] for c in chunk]
                continue
            # a client's reply is elementwise work on one model's values: one thread, as the
            # ClientApp takes (threads waiting on a busy core cost more than they share)
            torch.set_num_threads(1)
            for client, weights in zip(chunk, trained, strict=True):
                try:
                    results[client.index] = client.result(calls[client.index], weights)
                except Exception as err:
                    if not return_exceptions:
                        raise
                    results[client.index] = err
    finally:
        torch.set_num_threads(threads)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


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


def _chunks(clients: list[_Client], numel: int, chunk_bytes: int | None) -> list[list[_Client]]:
    """The clients in chunks whose per-sample gradients fit ``chunk_bytes`` at about twice
    their expected batch (Poisson batches vary), a chunk's inputs of one shape and dtype."""
    chunks: list[list[_Client]] = []
    current: list[_Client] = []
    used = 0

    def kind(client: _Client) -> tuple[object, ...]:
        return (tuple(client.x.shape[1:]), client.x.dtype, client.y.dtype, str(client.device))

    for client in sorted(clients, key=lambda c: str(kind(c))):  # stable: the calls' order
        if current and kind(current[0]) != kind(client):
            chunks.append(current)
            current, used = [], 0
        cost = 2 * max(1, client.expected_batch) * numel * 4
        limit = chunk_bytes
        if limit is None:
            limit = CUDA_CHUNK_BYTES if client.device.type == "cuda" else CHUNK_BYTES
        if current and used + cost > limit:
            chunks.append(current)
            current, used = [], 0
        current.append(client)
        used += cost
    if current:
        chunks.append(current)
    return chunks
