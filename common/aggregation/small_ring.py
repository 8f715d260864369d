"""A small ring for secure aggregation: flattening, conditional rounding and modular clipping.

``secure.py``'s exact ring is as wide as the worst case needs: it assumes one coordinate may
hold a client's whole norm and that no coordinate of the sum may ever wrap, so at 1,000
clients of 3,800 kept values it is 24 bits a value. A **small ring** (``secagg-ring-bits =
b``, ``RingParams.modular``) fixes ``b`` and spends it where "The Distributed Discrete
Gaussian Mechanism for Federated Learning with Secure Aggregation" (Kairouz, Liu and Steinke,
arXiv:2102.06387) does:

**Flattening.** A client's clipped values are rotated by a public orthogonal map before they
are scaled: random signs, then the normalised Walsh-Hadamard transform, over two windows of
``d' = 2^floor(log2 k)`` coordinates, the first ``[0, d')`` and the last ``[k - d', k)`` (they
overlap unless ``k`` is a power of two, so no padding is sent). Both windows' signs come from
SHAKE-256 of the round's id and nonce (:func:`rotation_seed`): every party derives them, the
data choose nothing. Orthogonal, it keeps every norm (the sensitivity is unchanged), and it
spreads any vector ``v``: each output coordinate is a Rademacher sum whose coefficients have
squared norm at most ``||v||^2 / d'``, sub-Gaussian with that proxy (the second window's signs
are independent of what the first window gave it), so no coordinate carries much more than
``||v|| / sqrt(d')`` however the values lie.

**Conditional rounding.** Stochastic rounding moves each coordinate by less than 1, so the
exact ring charges ``sC + sqrt(k)`` of sensitivity, which at a small scale is most of it. The
small ring rounds *conditionally* (Kairouz et al., Sec. 4.1): it draws the unbiased rounding
again until the rounded vector's squared norm is at most ``Delta^2``, with

    Delta^2 = (sC)^2 + k/4 + sqrt(2 ln(1/beta)) (sC + sqrt(k)/2),   beta = exp(-1/2),

which their concentration bound says one draw meets with probability at least ``1 - beta``
(:func:`rounding_bound`; the tests measure the rate). The check is exact, on the integers, so
``Delta`` is a deterministic bound on what a client adds to the sum: the sensitivity the
noise covers, ``Delta`` instead of ``sC + sqrt(k)``. A zeroed client rounds to zero. The
retries make the rounding slightly biased (towards shorter vectors): a cost in accuracy only.

**Modular clipping.** The sum is reduced mod ``2^b`` and lifted to ``[-2^(b-1), 2^(b-1))``;
a coordinate outside that range wraps and comes back wrong. That costs accuracy, never
privacy: the released value is a function of the noisy sum. The scale ``s`` is the largest
that keeps ``SIGNAL_STDDEVS`` standard deviations of a coordinate of the sum inside the ring
(Kairouz et al.'s heuristic, their ``k = 4``), in value units with step ``g = 1/s``:

    V(g) = n^2 C^2 / d' + n g^2 / 4 + n (sigma C)^2 / t,     2^b g = 2 z sqrt(V(g)),

the first term the sum's worst case (all ``n`` clients in one direction, norm ``nC``,
flattened), the second the rounding, the third the noise shares; solved in closed form by
:func:`small_scale`. It needs ``2^(b-1) > z sqrt(n) / 2``. :func:`expected_wraps` gives the
sub-Gaussian bound on the expected number of coordinates that wrap at that worst case (about
2.5 of 3,800 at 12 bits: union bounds over ``k`` give nothing at ``z = 4``); sums of updates
that are not all aligned wrap far less.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import numpy as np
import torch

__all__ = [
    "BETA",
    "MAX_TRIES",
    "SIGNAL_STDDEVS",
    "calibrate_sigma",
    "conditional_round",
    "expected_wraps",
    "flatten",
    "pack_bits",
    "rotation_seed",
    "rounding_bound",
    "small_scale",
    "unflatten",
    "unpack_bits",
    "window",
]

BETA = math.exp(-0.5)
"""The conditional rounding's ``beta``: one draw meets :func:`rounding_bound` with probability
at least ``1 - beta`` (about 0.39), so ``sqrt(2 ln(1/beta)) = 1``."""

SIGNAL_STDDEVS = 4.0
"""``z``: the standard deviations of a coordinate of the sum the ring holds (Kairouz et al.)."""

MAX_TRIES = 10_000
"""The most draws :func:`conditional_round` makes (at ``1 - beta`` each, ``0.61^10000``)."""

_ROTATION = b"fedsparse/secagg/rotation/v1\x00"


def rotation_seed(round_id: int, nonce: bytes) -> bytes:
    """The 32-byte seed of a round's rotation: SHA-256 of the round's id and the server's
    nonce (public: everyone who holds the round's setup derives it)."""
    digest = hashlib.sha256(_ROTATION)
    digest.update(round_id.to_bytes(8, "big"))
    digest.update(len(nonce).to_bytes(4, "big") + nonce)
    return digest.digest()


def window(kept: int) -> int:
    """``d'``: the largest power of two at most ``kept``, each window's size."""
    if kept < 1:
        raise ValueError(f"kept must be >= 1, got {kept}")
    return 1 << (kept.bit_length() - 1)


def _signs(seed: bytes, kept: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two windows' random signs (+-1, ``float64``), from SHAKE-256 of the seed."""
    size = window(kept)
    raw = hashlib.shake_256(_ROTATION + seed).digest(2 * ((size + 7) // 8))
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
    signs = torch.from_numpy(1.0 - 2.0 * bits.astype(np.float64))
    return signs[:size], signs[(size + 7) // 8 * 8 :][:size]


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """The normalised Walsh-Hadamard transform of a power-of-two vector (its own inverse)."""
    n = x.numel()
    y = x.clone()
    h = 1
    while h < n:
        y = y.view(-1, 2, h)
        y = torch.stack((y[:, 0] + y[:, 1], y[:, 0] - y[:, 1]), dim=1).reshape(-1)
        h *= 2
    return y / math.sqrt(n)


def flatten(values: torch.Tensor, seed: bytes) -> torch.Tensor:
    """The round's rotation of ``k`` values (``float64``): signs and Hadamard on the first
    window, then on the last (the module docstring)."""
    v = values.to(torch.float64).clone()
    kept = v.numel()
    size = window(kept)
    first, last = _signs(seed, kept)
    v[:size] = _hadamard(v[:size] * first)
    v[kept - size :] = _hadamard(v[kept - size :] * last)
    return v


def unflatten(values: torch.Tensor, seed: bytes) -> torch.Tensor:
    """The inverse of :func:`flatten` (its transpose: the last window first)."""
    v = values.to(torch.float64).clone()
    kept = v.numel()
    size = window(kept)
    first, last = _signs(seed, kept)
    v[kept - size :] = _hadamard(v[kept - size :]) * last
    v[:size] = _hadamard(v[:size]) * first
    return v


def rounding_bound(scaled_clip: float, kept: int) -> float:
    """``Delta``: the squared-norm bound conditional rounding enforces, for values of L2 norm
    at most ``scaled_clip`` (``sC``) over ``kept`` coordinates (the module docstring)."""
    c = scaled_clip
    slack = math.sqrt(2 * math.log(1 / BETA))
    return math.sqrt(c * c + kept / 4 + slack * (c + math.sqrt(kept) / 2))


def conditional_round(
    values: torch.Tensor, bound: float, generator: torch.Generator
) -> torch.Tensor:
    """Unbiased stochastic rounding (``int64``), drawn again until the rounded vector's squared
    norm, computed exactly on the integers, is at most ``floor(bound^2)``.

    ``ValueError`` if :data:`MAX_TRIES` draws all miss (the values' norm is over the one the
    bound was made for)."""
    v = values.to(torch.float64)
    low = torch.floor(v)
    frac = v - low
    base = low.to(torch.int64)
    limit = math.floor(bound * bound)
    # ||q|| < ||v|| + sqrt(k): below 2^31 the squares and their sum stay inside int64,
    # above it they are summed as Python ints (exact either way)
    small = float(torch.linalg.vector_norm(v)) + math.sqrt(v.numel()) < 2**31
    for _ in range(MAX_TRIES):
        up = torch.rand(v.shape, generator=generator, dtype=torch.float64) < frac
        q = base + up.to(torch.int64)
        norm2 = int((q * q).sum()) if small else sum(x * x for x in q.tolist())
        if norm2 <= limit:
            return q
    raise ValueError(
        f"no rounding within the norm bound {bound:.6g} in {MAX_TRIES} draws (norm "
        f"{float(torch.linalg.vector_norm(v)):.6g})"
    )


def small_scale(
    *, bits: int, clip: float, sigma: float, clients: int, threshold: int, kept: int
) -> float:
    """The scale ``s = 1/g`` of a ``bits``-bit small ring: ``2^b g = 2 z sqrt(V(g))`` solved
    for ``g`` (the module docstring), ``ValueError`` where the ring cannot hold the rounding
    of ``clients`` clients at all."""
    z = SIGNAL_STDDEVS
    half = (1 << (bits - 1)) / z  # 2^(b-1) / z: g * half = sqrt(V(g))
    spread = clients * clients * clip * clip / window(kept)
    spread += clients * (sigma * clip) ** 2 / threshold
    room = half * half - clients / 4
    if not room > 0:
        raise ValueError(
            f"a {bits}-bit ring cannot hold the rounding of {clients} clients: it needs "
            f"2^(b-1) > {z:g} sqrt(n) / 2 = {z * math.sqrt(clients) / 2:.4g}"
        )
    return math.sqrt(room / spread)


def expected_wraps(
    *, bits: int, scale: float, clip: float, share_std: float, clients: int, kept: int
) -> float:
    """A bound on the expected number of the sum's ``k`` coordinates that wrap when all
    ``clients`` point one way: ``2 k exp(-(2^(b-1) - 1)^2 / (2 V))``, ``V = n^2 (sC)^2 / d' +
    n/4 + n share_std^2`` in ring units (each coordinate sub-Gaussian: the flattened signal,
    the rounding errors (range 1, proxy 1/4, taken as unconditioned) and the shares)."""
    variance = (clients * scale * clip) ** 2 / window(kept)
    variance += clients / 4 + clients * share_std**2
    margin = (1 << (bits - 1)) - 1
    return 2 * kept * math.exp(-(margin * margin) / (2 * variance))


def calibrate_sigma(central: float, carried: Callable[[float], float]) -> float:
    """A sigma whose ring carries the central noise multiplier ``central`` (``carried(sigma)``
    at least it), by bisection between ``central`` (which never carries it: the rounding takes
    some of the sensitivity) and the first doubling that does, to a relative 1e-12; the upper
    end. ``ValueError`` where no sigma does: as sigma grows a small ring's scale, and with it
    ``sC / Delta``, falls, so a ring too small for its clients' rounding caps what it carries.
    A sigma whose ring is refused (``carried`` raises ``ValueError``) carries nothing."""

    def carries(sigma: float) -> bool:
        try:
            return carried(sigma) >= central
        except ValueError:
            return False

    low, high = central, 2 * central
    for _ in range(60):
        if carries(high):
            break
        low, high = high, 2 * high
    else:
        raise ValueError(
            f"this ring carries no central noise multiplier {central}: its rounding takes more "
            "of the sensitivity as sigma grows"
        )
    while high - low > 1e-12 * high:
        middle = (low + high) / 2
        low, high = (low, middle) if carries(middle) else (middle, high)
    return high


def pack_bits(values: torch.Tensor, bits: int) -> bytes:
    """Ring elements as ``bits`` bits each, little-endian, end to end:
    ``ceil(k bits / 8)`` bytes, the last byte's spare bits zero."""
    words = values.to(torch.int64).numpy().astype("<u8")
    planes = np.unpackbits(words.view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")
    return np.packbits(planes[:, :bits].reshape(-1), bitorder="little").tobytes()


def unpack_bits(data: bytes, kept: int, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack_bits`; ``ValueError`` for a wrong length or spare bits set."""
    expected = (kept * bits + 7) // 8
    if len(data) != expected:
        raise ValueError(f"expected {expected} bytes ({kept} x {bits} bits), got {len(data)}")
    flat = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    if flat[kept * bits :].any():
        raise ValueError("the packed ring elements' spare bits are not zero")
    planes = np.zeros((kept, 64), dtype=np.uint8)
    planes[:, :bits] = flat[: kept * bits].reshape(kept, bits)
    words = np.packbits(planes, axis=1, bitorder="little").reshape(-1).view("<u8")
    return torch.from_numpy(words.astype(np.int64))
