"""Secure aggregation's math: the integer ring, the distributed noise, the masks.

Every client of a round masks the same ``k`` kept coordinates (the round's seed-shared mask),
so the masked sum runs over ``k`` ring elements per client, not the model's dimension.

**Ring.** A client's kept values ``x`` (clipped here to L2 norm ``C``) are scaled by ``s``,
stochastically rounded to integers (unbiased: ``E[SR(v)] = v``), given an integer noise
share, and reduced mod ``2^b`` (:func:`encode`; its two ``torch.Generator`` streams, rounding
and noise, are the caller's: the client seeds them from OS entropy). The server decodes the
ring sum by the centered lift (``r - 2^b`` when ``r >= 2^(b-1)``) and divides by ``s``. The
scale keeps the rounding's cost on the sensitivity to a fraction ``gamma``
(``rounding_slack``): rounding moves each coordinate by less than 1, so the rounded vector's
norm is at most ``sC + sqrt(k)`` and ``s = sqrt(k) / (gamma C)`` makes that ``(1 + gamma) sC``.

**Wrap bound.** Coordinate ``j`` of the sum over ``m <= n`` clients is ``S_j = Q_j + Z_j``:
``|Q_j| <= n (sC + 1)`` (``|x_j| <= ||x||_2 <= C``, rounding adds less than 1), and ``Z_j``,
a sum of ``m`` independent discrete Gaussians of variance parameter ``v = (s sigma C)^2 / t``,
is sub-Gaussian with proxy ``V = n v`` (arXiv:2004.00010). The centered lift is exact while
``-2^(b-1) <= S_j < 2^(b-1)``, so with ``a = 2^(b-1) - 1 - n (sC + 1)``, ``P(some coordinate
wraps) <= 2 k exp(-a^2 / (2 V))`` (a union bound over k): :func:`choose_ring` takes the
smallest ``b`` that puts this below ``wrap_probability``.

**Noise shares**: each client adds discrete Gaussian noise ``N_Z(0, (s sigma C)^2 / t)`` in
ring units; any ``m >= t`` survivors' shares sum to variance ``m/t (s sigma C)^2``; the
sampler and the sum's divergence from one discrete Gaussian are ``discrete_noise.py``'s, and
:func:`check_ring` refuses a noisy ring where ``k tau`` exceeds ``TAU_LIMIT``. A small ring
(``small_ring.py``) flattens, rounds conditionally and wraps.

**Masks** (Bonawitz et al.'s "Practical Secure Aggregation for Privacy-Preserving Machine
Learning"; Bell et al.'s SecAgg+): pairwise and self masks expanded from 32-byte seeds by
SHAKE-256 (``secure_masks.py``, re-exported here with the ring's packing).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from fedsparse.common.aggregation import graph, small_ring
from fedsparse.common.aggregation.discrete_noise import (
    discrete_gaussian,
    discrete_gaussian_variance,
    stochastic_round,
    sum_divergence_tau,
)
from fedsparse.common.aggregation.secure_masks import (
    PAIR_LABEL,
    SEED_BYTES,
    SELF_LABEL,
    expand_mask,
    mask_input,
    pack_ring,
    pairwise_sign,
    remove_masks,
    ring_sum,
    unpack_ring,
)

__all__ = [
    "PAIR_LABEL",
    "SEED_BYTES",
    "SELF_LABEL",
    "RingParams",
    "central_noise_multiplier",
    "check_ring",
    "check_threshold",
    "choose_ring",
    "decode_sum",
    "discrete_gaussian",
    "discrete_gaussian_variance",
    "encode",
    "expand_mask",
    "mask_input",
    "noise_share_std",
    "pack_input",
    "pack_ring",
    "pairwise_sign",
    "quantize",
    "smallest_threshold",
    "remove_masks",
    "ring_for_central",
    "ring_sum",
    "stochastic_round",
    "sum_divergence_tau",
    "unpack_input",
    "unpack_ring",
    "worst_case_noise_multiplier",
    "wrap_probability_bound",
]

MAX_BITS = 62
"""The largest ring: two elements below ``2^62`` add without leaving ``int64``."""

DECODE_BITS = 54
"""The largest ring :func:`choose_ring` picks: every centered lift is exact in ``float64``."""

TAU_LIMIT = 1e-6
"""The most ``k tau`` (the sum's divergence from one discrete Gaussian) a noisy ring may have."""


def check_threshold(clients: int, threshold: int, colluders: int = 0) -> None:
    """Refuse a threshold that lets a lying server and ``colluders`` clients betray a client.

    Each honest client answers the unmask stage once, giving a node's self-seed share or its
    ``sk1`` share, never both; a colluding client gives both, and the victim gives its own
    seed share. Rebuilding both secrets of one victim from ``t`` shares each then needs
    ``2t - c - 1`` answers out of the ``n - 1`` other clients, so ``2t - n > c`` (with
    ``c = 0``: ``t > n/2``) stops a server that tells clients different stories of who
    dropped. It does not stop fake peers (unauthenticated keys): that needs a PKI.
    """
    if clients < 2:
        raise ValueError(f"secure aggregation needs at least 2 clients, got {clients}")
    if colluders < 0:
        raise ValueError(f"colluders must be >= 0, got {colluders}")
    if not (clients + colluders) / 2 < threshold <= clients:
        raise ValueError(
            f"threshold must satisfy 2t - n > c and t <= n (n={clients}, c={colluders}), "
            f"got t={threshold}"
        )


def smallest_threshold(clients: int, colluders: int = 0) -> int:
    """The smallest ``t`` with ``2t - n > c``: the most dropouts :func:`check_threshold` allows.

    ``ValueError`` where no ``t <= n`` satisfies it (fewer than 2 clients, or too many
    colluders for ``n``)."""
    threshold = (clients + colluders) // 2 + 1
    check_threshold(clients, threshold, colluders)
    return threshold


@dataclass(frozen=True)
class RingParams:
    """The public parameters of one round's secure sum (everyone can derive them)."""

    clip: float
    """``C``: the L2 bound of a client's kept values (clipped to it when encoded)."""
    sigma: float
    """The central noise multiplier the sum of any ``threshold`` clients carries (0: none)."""
    clients: int
    """``n``: the clients that start the round."""
    threshold: int
    """``t``: the fewest survivors the sum is decoded for; each share is ``1/sqrt(t)``."""
    kept: int
    """``k``: the kept coordinates, one ring element each."""
    scale: float
    """``s``: ring units per value unit."""
    bits: int
    """``b``: the ring is the integers mod ``2^b``."""
    colluders: int = 0
    """``c``: the clients that may collude with the server; the threshold keeps ``2t - n > c``."""
    neighbours: int = 0
    """Each client's neighbours in a sparse ring (SecAgg+: ``common/aggregation/graph.py``;
    even, at most ``n - 2``); 0: every other client (the complete graph)."""
    modular: bool = False
    """A small ring (``small_ring.py``): values flattened by the round's rotation, rounded
    conditionally, bit-packed, wraps allowed; False: the exact ring of this module."""

    def __post_init__(self) -> None:
        check_threshold(self.clients, self.threshold, self.colluders)
        sparse_ok = 2 <= self.neighbours <= self.clients - 2 and not self.neighbours % 2
        if self.neighbours and not sparse_ok:
            raise ValueError(
                "neighbours must be 0 (the complete graph) or even in [2, clients - 2 = "
                f"{self.clients - 2}], got {self.neighbours}"
            )
        for name in ("clip", "scale"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be positive and finite, got {value}")
        if not (self.sigma >= 0 and math.isfinite(self.sigma)):
            raise ValueError(f"sigma must be >= 0 and finite, got {self.sigma}")
        if self.kept < 1:
            raise ValueError(f"kept must be >= 1, got {self.kept}")
        if not 2 <= self.bits <= MAX_BITS:
            raise ValueError(f"bits must be in [2, {MAX_BITS}], got {self.bits}")
        if self.modular and self.bits > DECODE_BITS:
            raise ValueError(f"a small ring has at most {DECODE_BITS} bits, got {self.bits}")

    def share_threshold(self, members: int) -> int:
        """The shares that rebuild a secret of a ring of ``members``: ``threshold`` over the
        complete graph, :func:`graph.share_threshold` over a sparse one."""
        if not self.neighbours:
            return self.threshold
        return graph.share_threshold(members, self.neighbours, self.colluders)

    @property
    def modulus(self) -> int:
        return 1 << self.bits

    @property
    def share_std(self) -> float:
        """A client's noise share, in ring units: ``s sigma C / sqrt(t)``."""
        return self.scale * noise_share_std(self.sigma, self.clip, self.threshold)

    @property
    def sensitivity(self) -> float:
        """L2 bound of a client's rounded, scaled values: ``sC + sqrt(k)``; in a small ring
        the conditional rounding's bound (``small_ring.rounding_bound``)."""
        if self.modular:
            return small_ring.rounding_bound(self.scale * self.clip, self.kept)
        return self.scale * self.clip + math.sqrt(self.kept)

    @property
    def input_bytes(self) -> int:
        """Bytes of a masked input on the wire: ``k ceil(b/8)``; a small ring's, bit-packed,
        ``ceil(k b / 8)``."""
        if self.modular:
            return (self.kept * self.bits + 7) // 8
        return self.kept * ((self.bits + 7) // 8)


def choose_ring(
    *,
    clip: float,
    sigma: float,
    clients: int,
    threshold: int,
    kept: int,
    wrap_probability: float = 1e-9,
    rounding_slack: float = 0.01,
    colluders: int = 0,
    bits: int = 0,
) -> RingParams:
    """The scale ``s = sqrt(k) / (gamma C)`` and the smallest ring whose wrap bound holds; with
    ``bits > 0`` a small ring of that width and its scale (``small_ring.small_scale``;
    ``wrap_probability`` and ``rounding_slack`` then play no part).

    ``ValueError`` for a ring over :data:`DECODE_BITS` bits, or a noisy one whose sum is too
    far from one discrete Gaussian for the accounting (``k tau > TAU_LIMIT``).
    """
    check_threshold(clients, threshold, colluders)
    if not (clip > 0 and math.isfinite(clip)):
        raise ValueError(f"clip must be positive and finite, got {clip}")
    if not (sigma >= 0 and math.isfinite(sigma)):
        raise ValueError(f"sigma must be >= 0 and finite, got {sigma}")
    if kept < 1:
        raise ValueError(f"kept must be >= 1, got {kept}")
    if not 0 < wrap_probability < 1:
        raise ValueError(f"wrap_probability must be in (0, 1), got {wrap_probability}")
    if not (rounding_slack > 0 and math.isfinite(rounding_slack)):
        raise ValueError(f"rounding_slack must be positive and finite, got {rounding_slack}")
    small = bits != 0
    if small:
        if not 2 <= bits <= DECODE_BITS:
            raise ValueError(f"bits must be 0 or in [2, {DECODE_BITS}], got {bits}")
        scale = small_ring.small_scale(
            bits=bits, clip=clip, sigma=sigma, clients=clients, threshold=threshold, kept=kept
        )
    else:
        scale = math.sqrt(kept) / (rounding_slack * clip)
        signal = clients * (scale * clip + 1)
        variance = clients * (scale * sigma * clip) ** 2 / threshold
        tail = math.sqrt(2 * variance * math.log(2 * kept / wrap_probability))
        bits = max(2, math.ceil(math.log2(signal + 1 + tail)) + 1)
        if bits > DECODE_BITS:
            raise ValueError(f"the ring needs {bits} bits, more than {DECODE_BITS}")
    params = RingParams(clip, sigma, clients, threshold, kept, scale, bits, colluders)
    params = dataclasses.replace(params, modular=True) if small else params
    tau = sum_divergence_tau(params.share_std, clients) * kept
    if sigma > 0 and not tau <= TAU_LIMIT:
        raise ValueError(
            f"the noise shares ({params.share_std:.3g} ring units) are too small for the "
            f"accounting: k tau = {tau:.3g} > {TAU_LIMIT} (raise sigma or "
            f"{'widen the ring' if small else 'lower rounding_slack'})"
        )
    return params


def check_ring(
    params: RingParams,
    *,
    min_noise_multiplier: float,
    colluders: int = 0,
    wrap_probability: float = 1e-9,
    rounding_slack: float = 0.01,
) -> None:
    """A client's own check of a round's ring (``ValueError`` naming what is wrong).

    The server writes the parameters, so the client recomputes what follows from them:
    the threshold against ``colluders`` (its own bound, at most the ring's declared ``c``),
    ``sigma > 0``, the scale and bits :func:`choose_ring` gives for its own
    ``wrap_probability`` and ``rounding_slack`` (a small ring's, for its width: those two
    play no part there), and a worst-case noise multiplier (its share alone) of at least its
    own ``min_noise_multiplier``.
    """
    if params.colluders < colluders:
        raise ValueError(
            f"colluders is {params.colluders}, this node requires at least {colluders}"
        )
    if not params.sigma > 0:
        raise ValueError(f"sigma must be positive, got {params.sigma}")
    expected = choose_ring(
        clip=params.clip,
        sigma=params.sigma,
        clients=params.clients,
        threshold=params.threshold,
        kept=params.kept,
        wrap_probability=wrap_probability,
        rounding_slack=rounding_slack,
        colluders=params.colluders,
        bits=params.bits if params.modular else 0,
    )
    for name in ("scale", "bits"):
        if getattr(params, name) != getattr(expected, name):
            raise ValueError(
                f"{name} is {getattr(params, name)!r}, the parameters give "
                f"{getattr(expected, name)!r}"
            )
    worst = worst_case_noise_multiplier(params)
    if not worst >= min_noise_multiplier:
        raise ValueError(
            f"the worst-case noise multiplier (this node's share alone) is {worst:.4g}, "
            f"below this node's minimum {min_noise_multiplier}"
        )


def wrap_probability_bound(params: RingParams) -> float:
    """The module docstring's bound on P(some coordinate of the sum wraps), at most 1; a small
    ring's is ``small_ring.expected_wraps``, the expected number of wrapped coordinates when
    all clients point one way, at most 1 (by Markov's inequality also a bound on P(any))."""
    if params.modular:
        wraps = small_ring.expected_wraps(
            bits=params.bits,
            scale=params.scale,
            clip=params.clip,
            share_std=params.share_std,
            clients=params.clients,
            kept=params.kept,
        )
        return min(1.0, wraps)
    margin = (params.modulus >> 1) - 1 - params.clients * (params.scale * params.clip + 1)
    variance = params.clients * params.share_std**2
    if variance == 0:
        return 0.0 if margin >= 0 else 1.0
    if margin <= 0:
        return 1.0
    return min(1.0, 2 * params.kept * math.exp(-(margin**2) / (2 * variance)))


def noise_share_std(sigma: float, clip: float, threshold: int) -> float:
    """A client's noise share in value units: ``sigma C / sqrt(t)``."""
    return sigma * clip / math.sqrt(threshold)


def central_noise_multiplier(params: RingParams, survivors: int) -> float:
    """The noise multiplier of the decoded sum of ``survivors`` clients' shares, once.

    Noise std ``s sigma C sqrt((m-c)/t)`` (the ``c`` colluders can subtract their own shares)
    over the rounded sensitivity ``sC + sqrt(k)``: ``sigma sqrt((m-c)/t) / (1 + sqrt(k)/(sC))``,
    at least ``sigma / (1 + gamma)`` for ``m >= t`` and ``c = 0``. The adjacency: one client's
    values zeroed, its noise share still there. A small ring's sensitivity is its rounding
    bound ``Delta``.
    """
    if survivors < params.threshold:
        raise ValueError(f"{survivors} survivors, fewer than the threshold {params.threshold}")
    return params.share_std * math.sqrt(survivors - params.colluders) / params.sensitivity


def ring_for_central(
    central: float,
    *,
    clip: float,
    clients: int,
    threshold: int,
    kept: int,
    colluders: int = 0,
    wrap_probability: float = 1e-9,
    rounding_slack: float = 0.01,
    bits: int = 0,
) -> RingParams:
    """The ring (:func:`choose_ring`) whose decoded sum carries a central noise multiplier of
    at least ``central`` whichever ``m >= t`` clients survive: the fewest, ``t``, carry
    ``sigma sqrt((t - c) / t) / (1 + gamma)`` (:func:`central_noise_multiplier`), so
    ``sigma = central (1 + gamma) sqrt(t / (t - c))``, raised by a few float64 ulps where
    rounding leaves it short. More survivors carry more: ``sqrt((m - c) / (t - c))`` times
    ``central``. A small ring's (``bits > 0``) scale falls as sigma grows, so its sigma is
    found by bisection (``small_ring.calibrate_sigma``).
    """
    if not (central > 0 and math.isfinite(central)):
        raise ValueError(f"central must be positive and finite, got {central}")
    check_threshold(clients, threshold, colluders)
    if bits:  # a ring too narrow for its clients' rounding whatever sigma: said first
        small_ring.small_scale(
            bits=bits, clip=clip, sigma=0.0, clients=clients, threshold=threshold, kept=kept
        )
        ring = functools.partial(
            choose_ring,
            clip=clip,
            clients=clients,
            threshold=threshold,
            kept=kept,
            colluders=colluders,
            bits=bits,
        )
        sigma = small_ring.calibrate_sigma(
            central, lambda sigma: central_noise_multiplier(ring(sigma=sigma), threshold)
        )
        return ring(sigma=sigma)
    sigma = central * (1 + rounding_slack) * math.sqrt(threshold / (threshold - colluders))
    for _ in range(64):
        params = choose_ring(
            clip=clip,
            sigma=sigma,
            clients=clients,
            threshold=threshold,
            kept=kept,
            wrap_probability=wrap_probability,
            rounding_slack=rounding_slack,
            colluders=colluders,
        )
        if central_noise_multiplier(params, threshold) >= central:
            return params
        sigma = math.nextafter(sigma, math.inf)
    raise AssertionError(f"no sigma within 64 ulps of {sigma} gives {central}")  # pragma: no cover


def worst_case_noise_multiplier(params: RingParams) -> float:
    """A node's own share alone (everyone else colludes with the server): ``~sigma/sqrt(t)``."""
    return params.share_std / params.sensitivity


def quantize(
    values: torch.Tensor, params: RingParams, generator: torch.Generator, rotation: bytes = b""
) -> torch.Tensor:
    """Clip ``values`` to L2 norm ``C``, scale by ``s``, round stochastically (``int64``); in a
    small ring rotate them by ``rotation``'s map first (``small_ring.flatten``) and round
    conditionally on the norm bound (``small_ring.conditional_round``)."""
    if values.dim() != 1 or values.numel() != params.kept:
        raise ValueError(f"expected {params.kept} kept values, got shape {tuple(values.shape)}")
    v = values.to(torch.float64)
    norm = float(torch.linalg.vector_norm(v))
    if not math.isfinite(norm):
        raise ValueError("kept values must be finite")
    if norm > params.clip:
        v = v * (params.clip / norm)
    if not params.modular:
        return stochastic_round(v * params.scale, generator)
    if not rotation:
        raise ValueError("a small ring's values need the round's rotation seed")
    flat = small_ring.flatten(v, rotation) * params.scale
    return small_ring.conditional_round(flat, params.sensitivity, generator)


def encode(
    values: torch.Tensor,
    params: RingParams,
    rounding: torch.Generator,
    noise: torch.Generator,
    rotation: bytes = b"",
) -> torch.Tensor:
    """A client's ring input: quantized values plus its discrete Gaussian share, mod ``2^b``
    (a small ring's values rotated by ``rotation``'s map: :func:`quantize`).

    Deterministic given the two generators: whoever can predict them can strip the noise from
    the decoded sum, so a client seeds them from OS entropy (``client/secagg.py``).
    """
    q = quantize(values, params, rounding, rotation)
    q = q + discrete_gaussian(params.kept, params.share_std, noise)
    return q & (params.modulus - 1)


def decode_sum(ring_total: torch.Tensor, params: RingParams, rotation: bytes = b"") -> torch.Tensor:
    """The centered lift of a ring sum, in value units (``float64``); a small ring's rotated
    back by ``rotation``'s map (``small_ring.unflatten``)."""
    half = params.modulus >> 1
    lifted = torch.where(ring_total >= half, ring_total - params.modulus, ring_total)
    total = lifted.to(torch.float64) / params.scale
    if not params.modular:
        return total
    if not rotation:
        raise ValueError("a small ring's sum needs the round's rotation seed")
    return small_ring.unflatten(total, rotation)


def pack_input(values: torch.Tensor, params: RingParams) -> bytes:
    """A masked input on the wire (``params.input_bytes``; a small ring's bit-packed)."""
    if params.modular:
        return small_ring.pack_bits(values, params.bits)
    return pack_ring(values, params.bits)


def unpack_input(data: bytes, params: RingParams) -> torch.Tensor:
    """The inverse of :func:`pack_input`; ``ValueError`` for a wrong length or element."""
    if params.modular:
        return small_ring.unpack_bits(data, params.kept, params.bits)
    return unpack_ring(data, params.kept, params.bits)
