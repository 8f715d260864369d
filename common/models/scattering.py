"""A fixed 2-D scattering transform (Morlet wavelets, order 2): the front end of the H-CNNs.

``Scattering2D(shape=(M, N), J=2, L=8)`` maps ``... x M x N`` images to
``... x K x M/2^J x N/2^J`` features, ``K = 1 + J*L + L^2*J*(J-1)/2`` (81 for J=2, L=8):

* order 0: ``x * phi_J``, the low-pass average;
* order 1: ``|x * psi_{j1,t1}| * phi_J`` for the ``J*L`` wavelets (scale ``j1 < J``,
  angle ``t1 < L``);
* order 2: ``||x * psi_{j1,t1}| * psi_{j2,t2}| * phi_J`` for ``j1 < j2``;

each subsampled by ``2^J``, in that channel order (order 2 by ``(j1, t1)`` then ``(j2, t2)``).
Convolutions run in the Fourier domain on the reflection-padded image, subsampling is
periodization of the spectrum, and one pixel of border is cropped at the output resolution.

It is a re-implementation of kymatio 0.3.0's ``Scattering2D`` (Andreux et al., "Kymatio:
Scattering Transforms in Python", JMLR 2020), the front end of Tramer & Boneh's ScatterNet
models: same filter bank (including kymatio's ``3.1415`` Gabor normalization), padding,
subsampling and output order. On this platform (torch 2.13, scipy 1.17, CPU) it equals
kymatio's output to 2e-7 (float32, relative to the output scale) on 3x32x32 and 1x28x28 inputs;
``tests/common/models/test_hcnn.py`` keeps reference values and checks against kymatio itself where
it is installed.

Why not depend on kymatio: its documented entry point ``from kymatio.torch import
Scattering2D`` fails to import with scipy >= 1.17 (``kymatio.torch`` also loads the 3-D
frontend, whose filter bank imports ``scipy.special.sph_harm``, removed in scipy 1.17), and
0.3.0 (2022) is its latest release. Its 2-D module alone does run with torch 2.13, but only
through an internal import path. The transform is ~150 lines of FFTs, so it lives here.

Guarantees for DP-SGD: the module has no parameters; its filters are non-persistent float
buffers (``requires_grad=False``, not in ``state_dict``, rebuilt identically on construction),
so Opacus, ``ParamLayout`` and the wire only ever see the CNN behind it. The output is a
deterministic function of the input (no randomness, no batch statistics: each image is
transformed alone), so it adds nothing to per-example sensitivity. Gradients flow to the input
if it requires them (``|z|`` at ``z = 0`` has gradient 0).

References:
    J. Bruna, S. Mallat. "Invariant Scattering Convolution Networks". IEEE TPAMI 2013.
    E. Oyallon, S. Mallat. "Deep Roto-Translation Scattering for Object Classification".
    CVPR 2015.
    M. Andreux et al. "Kymatio: Scattering Transforms in Python". JMLR 21(60), 2020.
    F. Tramer, D. Boneh. "Differentially Private Learning Needs Better Features (or Much
    More Data)". ICLR 2021. arXiv:2011.11660.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Scattering2D", "morlet_filter_bank", "scattering_channels"]

_Array = npt.NDArray[np.float64]

#: Images (2-D planes: an RGB image is 3) scattered at once; bounds the peak memory.
_CHUNK = 1024


def scattering_channels(*, J: int, L: int) -> int:
    """Number of output channels per input channel: ``1 + J*L + L^2 * J*(J-1)/2``."""
    return 1 + J * L + L * L * J * (J - 1) // 2


def _gabor(M: int, N: int, *, sigma: float, theta: float, xi: float, slant: float) -> np.ndarray:
    """Gabor filter in space, periodized over 5x5 tiles (kymatio's ``gabor_2d``)."""
    c, s = math.cos(theta), math.sin(theta)
    rot = np.array([[c, -s], [s, c]])
    curv = rot @ np.diag([1.0, slant * slant]) @ rot.T / (2 * sigma * sigma)
    xx = np.arange(-2 * M, 3 * M, dtype=np.float64).reshape(5, M, 1, 1)
    yy = np.arange(-2 * N, 3 * N, dtype=np.float64).reshape(1, 1, 5, N)
    arg = -(curv[0, 0] * xx * xx + (curv[0, 1] + curv[1, 0]) * xx * yy + curv[1, 1] * yy * yy)
    arg = arg + 1j * (xx * xi * c + yy * xi * s)
    gabor = np.exp(arg).sum(axis=(0, 2))
    return gabor / (2 * 3.1415 * sigma * sigma / slant)  # kymatio's constant, kept for parity


def _morlet(M: int, N: int, *, sigma: float, theta: float, xi: float, slant: float) -> np.ndarray:
    """Morlet filter in space: the Gabor minus its envelope times the zero-mean constant."""
    wave = _gabor(M, N, sigma=sigma, theta=theta, xi=xi, slant=slant)
    envelope = _gabor(M, N, sigma=sigma, theta=theta, xi=0.0, slant=slant)
    return wave - envelope * (wave.sum() / envelope.sum())


def _periodize(spectrum: _Array, res: int) -> _Array:
    """The spectrum of the filter at resolution ``2^-res`` (kymatio's ``periodize_filter_fft``).

    The band of frequencies that the subsampled grid cannot hold is zeroed, then the spectrum
    is folded (summed) onto an ``M/2^res x N/2^res`` grid.
    """
    M, N = spectrum.shape
    k = 2**res
    masked = spectrum.copy()
    start_x, len_x = int(M * 2 ** (-res - 1)), int(M * (1 - 2**-res))
    start_y, len_y = int(N * 2 ** (-res - 1)), int(N * (1 - 2**-res))
    masked[start_x : start_x + len_x, :] = 0
    masked[:, start_y : start_y + len_y] = 0
    return masked.reshape(k, M // k, k, N // k).sum(axis=(0, 2))


def morlet_filter_bank(
    M: int, N: int, *, J: int, L: int
) -> tuple[list[_Array], list[list[list[_Array]]]]:
    """Fourier-domain filters for an ``M x N`` (padded) grid, as kymatio's ``filter_bank``.

    Returns:
        ``(phi, psi)``: ``phi[res]`` is the low-pass ``phi_J`` at resolution ``2^-res``
        (``res < J``); ``psi[j][t][res]`` is the Morlet wavelet of scale ``j < J`` and angle
        index ``t < L`` at resolution ``2^-res`` (``res <= j``, ``res < max(J - 1, 1)``).
        All real: like kymatio, the real part of each spectrum is kept (the filters are
        conjugate-symmetric in space, so the imaginary part is negligible).
    """
    psi: list[list[list[_Array]]] = []
    for j in range(J):
        per_angle = []
        for t in range(L):
            wavelet = _morlet(
                M,
                N,
                sigma=0.8 * 2**j,
                theta=(int(L - L / 2 - 1) - t) * math.pi / L,
                xi=3.0 / 4.0 * math.pi / 2**j,
                slant=4.0 / L,
            )
            spectrum = np.real(np.fft.fft2(wavelet))
            levels = min(j + 1, max(J - 1, 1))  # the resolutions order 2 needs it at
            per_angle.append([_periodize(spectrum, res) for res in range(levels)])
        psi.append(per_angle)
    low = np.real(np.fft.fft2(_gabor(M, N, sigma=0.8 * 2 ** (J - 1), theta=0.0, xi=0.0, slant=1.0)))
    phi = [_periodize(low, res) for res in range(J)]
    return phi, psi


def _filter_subsample(spectrum: torch.Tensor, filt: torch.Tensor, k: int) -> torch.Tensor:
    """``spectrum * filt`` subsampled in space by ``k``: the mean of its ``k x k`` folds.

    ``spectrum`` is complex, ``filt`` real, broadcastable to each other over all dimensions.
    Spatial subsampling by ``k`` periodizes the spectrum; summing the folds of the product
    one at a time (on real views) never materializes the full-size product and runs ~5x
    faster on the CPU than multiplying, then reducing the complex tensor.
    """
    values = torch.view_as_real(spectrum)  # ... x m x n x 2
    weights = filt.to(values.dtype)[..., None]
    if k == 1:
        return torch.view_as_complex(values * weights)
    m, n = values.shape[-3:-1]
    values = values.unflatten(-3, (k, m // k)).unflatten(-2, (k, n // k))
    weights = weights.unflatten(-3, (k, m // k)).unflatten(-2, (k, n // k))
    folds = [(a, b) for a in range(k) for b in range(k)]
    out = values[..., 0, :, 0, :, :] * weights[..., 0, :, 0, :, :]
    for a, b in folds[1:]:
        # Out of place: in-place addcmul_ has no batching rule under torch.func.vmap (the
        # func DP engine), whose fallback loops over the examples.
        out = torch.addcmul(out, values[..., a, :, b, :, :], weights[..., a, :, b, :, :])
    return torch.view_as_complex(out / (k * k))


class Scattering2D(nn.Module):
    """Order-2 scattering of ``... x M x N`` images (module docstring), no parameters.

    Args:
        shape: ``(M, N)``, the spatial size of the input: ``2^J <= min(M, N)``, and the
            reflection padding (``2^J`` to ``1.5 * 2^J`` pixels a side) must be smaller than
            the image.
        J: number of scales (output subsampled by ``2^J``), >= 1.
        L: number of angles, >= 1 (the filters are designed for 8).

    Input ``... x M x N`` (any leading dimensions, e.g. ``B x C``); output
    ``... x K x M' x N'`` with ``K = scattering_channels(J=J, L=L)``, ``M' = M // 2^J`` (for
    ``M`` a multiple of ``2^J``; in general the padded size ``/ 2^J - 2``).

    Raises:
        ValueError: bad ``J``, ``L`` or ``shape``.
        RuntimeError: (forward) an input whose last two dimensions are not ``shape``, or one
            that is not floating point.
    """

    def __init__(self, *, shape: tuple[int, int], J: int = 2, L: int = 8) -> None:
        super().__init__()
        if J < 1 or L < 1:
            raise ValueError(f"J={J}, L={L}: expected J >= 1 and L >= 1")
        M, N = shape
        if min(M, N) < 2**J:
            raise ValueError(f"shape={tuple(shape)}: expected both sides >= 2^J = {2**J}")
        # kymatio's padded size: the next multiple of 2^J above M + 2^J.
        padded = [((s + 2**J) // 2**J + 1) * 2**J for s in (M, N)]
        self.pad = (  # F.pad order: left, right, top, bottom
            (padded[1] - N) // 2,
            (padded[1] - N + 1) // 2,
            (padded[0] - M) // 2,
            (padded[0] - M + 1) // 2,
        )
        if max(self.pad[2:]) >= M or max(self.pad[:2]) >= N:
            raise ValueError(f"shape={tuple(shape)}: too small for J={J} (padding >= side)")
        self.shape = (M, N)
        self.out_shape = (padded[0] // 2**J - 2, padded[1] // 2**J - 2)
        self.J, self.L = J, L
        self.out_channels = scattering_channels(J=J, L=L)
        phi, psi = morlet_filter_bank(padded[0], padded[1], J=J, L=L)
        for res, level in enumerate(phi):
            self._buffer(f"phi_{res}", level)
        for j, per_angle in enumerate(psi):
            for res in range(len(per_angle[0])):
                self._buffer(f"psi_{j}_{res}", np.stack([levels[res] for levels in per_angle]))

    def _buffer(self, name: str, array: _Array) -> None:
        tensor = torch.from_numpy(array.astype(np.float32))
        self.register_buffer(name, tensor, persistent=False)

    def _filter(self, name: str) -> torch.Tensor:
        filt: torch.Tensor = getattr(self, name)
        return filt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Scatter ``... x M x N`` images into ``... x K x M' x N'`` features."""
        if x.dim() < 2 or tuple(x.shape[-2:]) != self.shape:
            raise RuntimeError(
                f"input of shape {tuple(x.shape)}: expected ... x {self.shape[0]} x {self.shape[1]}"
            )
        if not x.is_floating_point():
            raise RuntimeError(f"input dtype {x.dtype}: expected a floating point tensor")
        lead = x.shape[:-2]
        if x.numel() == 0:  # an empty (Poisson) batch; MKL's FFT refuses empty tensors
            return x.new_zeros(*lead, self.out_channels, *self.out_shape)
        images = x.reshape(-1, 1, *self.shape)
        padded = F.pad(images, self.pad, mode="reflect")[:, 0]
        # Chunks bound the peak memory (~0.6 GB per chunk at 32x32, J=2, L=8).
        parts = [self._scatter(torch.fft.fft2(part)) for part in padded.split(_CHUNK)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.reshape(*lead, *out.shape[-3:])

    def _scatter(self, u0: torch.Tensor) -> torch.Tensor:
        """All orders from the spectrum ``u0`` (``B x Mp x Np``); ``B x K x M' x N'``."""
        J = self.J
        order0 = self._lowpass(u0, res=0)[:, None]
        order1, order2 = [], []
        envelopes = []  # spectrum of |x * psi_j1| for each j1: B x L x Mp/2^j1 x Np/2^j1
        for j1 in range(J):
            wave = _filter_subsample(u0[:, None], self._filter(f"psi_{j1}_0"), 2**j1)
            envelopes.append(torch.fft.fft2(torch.fft.ifft2(wave).abs()))
            order1.append(self._lowpass(envelopes[j1], res=j1))
        for j1 in range(J - 1):
            children = []
            for j2 in range(j1 + 1, J):
                psi = self._filter(f"psi_{j2}_{j1}")
                wave = _filter_subsample(envelopes[j1][:, :, None], psi, 2 ** (j2 - j1))
                children.append(self._lowpass(torch.fft.fft2(torch.fft.ifft2(wave).abs()), res=j2))
            paths = torch.cat(children, dim=2)  # B x L(t1) x L*(J-1-j1) (j2, t2) x M' x N'
            order2.append(paths.flatten(1, 2))
        return torch.cat([order0, *order1, *order2], dim=1)

    def _lowpass(self, spectrum: torch.Tensor, *, res: int) -> torch.Tensor:
        """``phi_J`` at resolution ``2^-res``, subsampled to ``2^-J``, cropped by 1 pixel."""
        low = _filter_subsample(spectrum, self._filter(f"phi_{res}"), 2 ** (self.J - res))
        return torch.fft.ifft2(low).real[..., 1:-1, 1:-1]

    def extra_repr(self) -> str:
        """Show the configuration in ``print(model)``."""
        return f"shape={self.shape}, J={self.J}, L={self.L}, out_channels={self.out_channels}"
