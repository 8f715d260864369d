"""Image classifiers for DP-SGD: tanh / tempered-sigmoid CNNs, no batch statistics.

Every model here is compatible with Opacus per-sample gradients: only ``Conv2d``, ``Linear``,
pooling, parameter-free activations and normalizations (``GroupNorm(affine=False)``, which
normalizes each example alone), never ``BatchNorm`` (its statistics mix examples, which breaks
per-example clipping). The H-CNNs put a fixed scattering transform (``scattering.Scattering2D``,
no parameters) in front of a small CNN: the "/S" models of the RS paper.

Models and their parameter counts (``num_classes=10``):

========================  ==========  =========  ====================================
name                      input       params     source
========================  ==========  =========  ====================================
``"dpcnn"``               3x32x32     550,570    Papernot et al. 2021, CIFAR-10 CNN
``"dpcnn-mnist"``         1x28x28      26,010    Papernot et al. 2021, MNIST CNN
``"digits-cnn"``          1x8x8        38,282    small CNN for sklearn digits
``"cifar10-hcnn"``        3x32x32     187,210    Tramer & Boneh 2021, ScatterNet+CNN
``"mnist-hcnn"``          1x28x28      33,066    Tramer & Boneh 2021, ScatterNet+CNN
========================  ==========  =========  ====================================

(Trainable parameters; the H-CNNs' scattering filters are fixed buffers, counted nowhere.)

References:
    N. Papernot, A. Thakurta, S. Song, S. Chien, U. Erlingsson. "Tempered Sigmoid Activations
    for Deep Learning with Differential Privacy". AAAI 2021. arXiv:2007.14191.
    J. Zhu, M. Blaschko. "Improving Differentially Private SGD via Randomly Sparsified
    Gradients". TMLR 2023. arXiv:2112.00845 (uses the same CIFAR-10 CNN, and the H-CNN).
    F. Tramer, D. Boneh. "Differentially Private Learning Needs Better Features (or Much
    More Data)". ICLR 2021. arXiv:2011.11660 (ScatterNet+CNN; code: ftramer/Handcrafted-DP,
    ``models.py`` ``CIFAR10_CNN``/``MNIST_CNN`` with ``in_channels=81*C``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import torch
from torch import nn

from fedsparse.common import plugins
from fedsparse.common.models.scattering import Scattering2D
from fedsparse.common.names import DEFAULT_MODELS, MODEL_INPUT_SHAPES, MODEL_NAMES, ModelName

if TYPE_CHECKING:
    pass

__all__ = [
    "DEFAULT_MODELS",
    "MODEL_INPUT_SHAPES",
    "MODEL_NAMES",
    "ActivationConfig",
    "DPCNN",
    "DPCNNMnist",
    "DigitsCNN",
    "HCNN",
    "HCNNMnist",
    "ModelName",
    "TemperedSigmoid",
    "build_model",
    "count_parameters",
    "make_activation",
    "model_input_shape",
]

_ACTIVATIONS: Final = ("tanh", "tempered_sigmoid")


@dataclass(frozen=True, kw_only=True)
class ActivationConfig:
    """Which nonlinearity the CNNs use between layers.

    Attributes:
        name: ``"tanh"`` or ``"tempered_sigmoid"``.
        scale: ``s`` in ``s * sigmoid(T * x) - o`` (tempered sigmoid only), > 0.
        inverse_temperature: ``T`` in ``s * sigmoid(T * x) - o`` (tempered sigmoid only), > 0.
        offset: ``o`` in ``s * sigmoid(T * x) - o`` (tempered sigmoid only), finite.

    The defaults ``s=2, T=2, o=1`` make the tempered sigmoid equal to ``tanh`` exactly
    (``2 * sigmoid(2x) - 1 = tanh(x)``), the family's best member in Papernot et al. 2021.
    """

    name: str = "tanh"
    scale: float = 2.0
    inverse_temperature: float = 2.0
    offset: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in _ACTIVATIONS:
            raise ValueError(f"name={self.name!r}: expected one of {', '.join(_ACTIVATIONS)}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale={self.scale}: expected a finite value > 0")
        if not (math.isfinite(self.inverse_temperature) and self.inverse_temperature > 0):
            raise ValueError(
                f"inverse_temperature={self.inverse_temperature}: expected a finite value > 0"
            )
        if not math.isfinite(self.offset):
            raise ValueError(f"offset={self.offset}: expected a finite value")


class TemperedSigmoid(nn.Module):
    """Tempered sigmoid ``s * sigmoid(T * x) - o`` (Papernot et al. 2021, eq. 3).

    Bounded in ``(-o, s - o)``, which bounds activations and so keeps gradient norms small
    under clipping. Has no parameters, so it needs no per-sample gradient support.
    """

    def __init__(
        self, *, scale: float = 2.0, inverse_temperature: float = 2.0, offset: float = 1.0
    ) -> None:
        super().__init__()
        self.scale = scale
        self.inverse_temperature = inverse_temperature
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the activation elementwise."""
        return self.scale * torch.sigmoid(self.inverse_temperature * x) - self.offset

    def extra_repr(self) -> str:
        """Show the three constants in ``print(model)``."""
        return (
            f"scale={self.scale}, inverse_temperature={self.inverse_temperature}, "
            f"offset={self.offset}"
        )


def make_activation(config: ActivationConfig | None = None) -> nn.Module:
    """Build a fresh activation module from ``config`` (``None`` means ``tanh``)."""
    config = config if config is not None else ActivationConfig()
    if config.name == "tanh":
        return nn.Tanh()
    return TemperedSigmoid(
        scale=config.scale,
        inverse_temperature=config.inverse_temperature,
        offset=config.offset,
    )


class DPCNN(nn.Module):
    """The CIFAR-10 CNN of Papernot et al. 2021 (also used by Zhu & Blaschko's RS-DPSGD).

    Three blocks of two 3x3 convolutions (padding 1) each followed by the activation, with a
    2x2 max-pool after each block (32 -> 64 -> 128 channels; 32 -> 16 -> 8 -> 4 pixels), then
    ``Linear(2048, 128)``, activation, ``Linear(128, num_classes)``. Input ``N x 3 x 32 x 32``;
    output logits ``N x num_classes``. 550,570 parameters for 10 classes.
    """

    def __init__(self, *, num_classes: int = 10, activation: ActivationConfig | None = None):
        super().__init__()
        _check_num_classes(num_classes)
        act = _activation_factory(activation)
        layers: list[nn.Module] = []
        in_channels = 3
        for out_channels in (32, 64, 128):
            layers += [
                nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1),
                act(),
                nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1),
                act(),
                nn.MaxPool2d(kernel_size=2, stride=2),
            ]
            in_channels = out_channels
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(128 * 4 * 4, 128),
            act(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``N x 3 x 32 x 32`` images to ``N x num_classes`` logits."""
        return self.classifier(self.features(x))


class DPCNNMnist(nn.Module):
    """The MNIST / Fashion-MNIST CNN of Papernot et al. 2021 (also Opacus' MNIST example).

    ``Conv2d(1, 16, 8, stride=2, padding=3)``, activation, ``MaxPool2d(2, 1)``,
    ``Conv2d(16, 32, 4, stride=2)``, activation, ``MaxPool2d(2, 1)``, flatten (32x4x4 = 512),
    ``Linear(512, 32)``, activation, ``Linear(32, num_classes)``. Spatial sizes
    28 -> 14 -> 13 -> 5 -> 4. Input ``N x 1 x 28 x 28``; 26,010 parameters for 10 classes.
    """

    def __init__(self, *, num_classes: int = 10, activation: ActivationConfig | None = None):
        super().__init__()
        _check_num_classes(num_classes)
        act = _activation_factory(activation)
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=8, stride=2, padding=3),
            act(),
            nn.MaxPool2d(kernel_size=2, stride=1),
            nn.Conv2d(16, 32, kernel_size=4, stride=2),
            act(),
            nn.MaxPool2d(kernel_size=2, stride=1),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 32),
            act(),
            nn.Linear(32, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``N x 1 x 28 x 28`` images to ``N x num_classes`` logits."""
        return self.classifier(self.features(x))


class DigitsCNN(nn.Module):
    """A small CNN for the 8x8 grayscale sklearn digits (the embedded, download-free dataset).

    ``Conv2d(1, 16, 3, padding=1)``, activation, ``Conv2d(16, 32, 3, padding=1)``, activation,
    ``MaxPool2d(2)`` (8 -> 4 pixels), flatten (32x4x4 = 512), ``Linear(512, 64)``, activation,
    ``Linear(64, num_classes)``. Input ``N x 1 x 8 x 8``; 38,282 parameters for 10 classes.
    """

    def __init__(self, *, num_classes: int = 10, activation: ActivationConfig | None = None):
        super().__init__()
        _check_num_classes(num_classes)
        act = _activation_factory(activation)
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1),
            act(),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            act(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 64),
            act(),
            nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``N x 1 x 8 x 8`` images to ``N x num_classes`` logits."""
        return self.classifier(self.features(x))


class _ScatterCNN(nn.Module):
    """Scattering (J=2, L=8) -> ``GroupNorm(27, 81*C, affine=False)`` -> ``features`` ->
    ``classifier``; the subclasses set the image shape and the two stacks."""

    def __init__(
        self, *, image_shape: tuple[int, int, int], features: nn.Module, classifier: nn.Module
    ) -> None:
        super().__init__()
        channels, height, width = image_shape
        self.scattering = Scattering2D(shape=(height, width), J=2, L=8)
        self.norm = nn.GroupNorm(27, channels * self.scattering.out_channels, affine=False)
        self.features = features
        self.classifier = classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``N x C x H x W`` images to ``N x num_classes`` logits."""
        scattered = self.scattering(x).flatten(1, 2)  # N x C x 81 x H/4 x W/4 -> N x 81C x ..
        return self.classifier(self.features(self.norm(scattered)))


class HCNN(_ScatterCNN):
    """The CIFAR-10 H-CNN: ScatterNet + CNN of Tramer & Boneh 2021 (the RS paper's "/S" model).

    ``Scattering2D(J=2, L=8)`` of each colour channel (3x32x32 -> 3x81x8x8 = 243x8x8, fixed
    filters, no parameters), ``GroupNorm(27, 243, affine=False)``, ``Conv2d(243, 64, 3,
    padding=1)``, activation, ``MaxPool2d(2)`` (8 -> 4 pixels), ``Conv2d(64, 64, 3, padding=1)``,
    activation, flatten (64x4x4 = 1024), ``Linear(1024, num_classes)``: Tramer & Boneh's
    ``CIFAR10_CNN`` config ``[64, 'M', 64]`` for scattered inputs. 140,032 + 36,928 + 10,250 =
    187,210 trainable parameters for 10 classes; this is the only arrangement of those layers
    that gives 187,210 (unpadded convolutions leave 64x1x1 features, a pool after each
    convolution 64x2x2). Input ``N x 3 x 32 x 32``, normalized as the dataset pipeline does
    (per-colour scale cancels in the GroupNorm: each group of 9 channels is one colour's).
    """

    def __init__(self, *, num_classes: int = 10, activation: ActivationConfig | None = None):
        _check_num_classes(num_classes)
        act = _activation_factory(activation)
        super().__init__(
            image_shape=(3, 32, 32),
            features=nn.Sequential(
                nn.Conv2d(243, 64, kernel_size=3, padding=1),
                act(),
                nn.MaxPool2d(kernel_size=2, stride=2),
                nn.Conv2d(64, 64, kernel_size=3, padding=1),
                act(),
            ),
            classifier=nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, num_classes)),
        )


class HCNNMnist(_ScatterCNN):
    """The MNIST / Fashion-MNIST H-CNN: ScatterNet + CNN of Tramer & Boneh 2021.

    ``Scattering2D(J=2, L=8)`` (1x28x28 -> 81x7x7, fixed filters, no parameters),
    ``GroupNorm(27, 81, affine=False)``, ``Conv2d(81, 16, 3, stride=2, padding=1)`` (7 -> 4
    pixels), activation, ``Conv2d(16, 32, 3, padding=1)``, activation, flatten (32x4x4 = 512),
    ``Linear(512, 32)``, activation, ``Linear(32, num_classes)``: Tramer & Boneh's
    ``MNIST_CNN`` config ``[(16, 3, 2, 1), (32, 3, 1, 1)]`` for scattered inputs. 11,680 +
    4,640 + 16,416 + 330 = 33,066 trainable parameters for 10 classes. Input
    ``N x 1 x 28 x 28``.
    """

    def __init__(self, *, num_classes: int = 10, activation: ActivationConfig | None = None):
        _check_num_classes(num_classes)
        act = _activation_factory(activation)
        super().__init__(
            image_shape=(1, 28, 28),
            features=nn.Sequential(
                nn.Conv2d(81, 16, kernel_size=3, stride=2, padding=1),
                act(),
                nn.Conv2d(16, 32, kernel_size=3, padding=1),
                act(),
            ),
            classifier=nn.Sequential(
                nn.Flatten(),
                nn.Linear(32 * 4 * 4, 32),
                act(),
                nn.Linear(32, num_classes),
            ),
        )


_ModelFactory = Callable[..., nn.Module]


_REGISTRY: Final[dict[ModelName, _ModelFactory]] = {
    "dpcnn": DPCNN,
    "dpcnn-mnist": DPCNNMnist,
    "digits-cnn": DigitsCNN,
    "cifar10-hcnn": HCNN,
    "mnist-hcnn": HCNNMnist,
}


def build_model(
    name: ModelName,
    *,
    num_classes: int = 10,
    activation: ActivationConfig | None = None,
    seed: int | None = 0,
) -> nn.Module:
    """Build a freshly initialised model by registry name.

    Args:
        name: One of :data:`MODEL_NAMES` (``"dpcnn"``, ``"dpcnn-mnist"``, ``"digits-cnn"``,
            ``"cifar10-hcnn"``, ``"mnist-hcnn"``), or a user's model as
            ``package.module:factory``, a callable ``factory(num_classes=...)`` returning an
            ``nn.Module`` (``common/plugins.py``; an ``input_shape`` attribute on it, ``C x H
            x W``, lets configs check it against the dataset).
        num_classes: Number of output logits, >= 2.
        activation: Nonlinearity; ``None`` means ``tanh``.
        seed: Seed for the initial weights. The same seed gives bit-identical weights (so a
            server and its clients can agree on round-0 weights); the global torch RNG is
            left untouched (the initialisation runs under ``torch.random.fork_rng``).
            ``None`` draws from the global torch RNG instead.

    Returns:
        The model, in training mode, on CPU, float32.

    Raises:
        ValueError: ``name`` is unknown (the message lists the valid names), a reference
            cannot be loaded or builds no module, or ``num_classes`` < 2.
    """
    if plugins.is_reference(name):
        return _build_user_model(name, num_classes=num_classes, activation=activation, seed=seed)
    if name not in _REGISTRY:
        raise ValueError(
            f"model name={name!r}: expected one of {', '.join(MODEL_NAMES)} "
            f"or {plugins.REFERENCE_FORMAT}"
        )
    factory = _REGISTRY[name]
    if seed is None:
        return factory(num_classes=num_classes, activation=activation)
    with torch.random.fork_rng(devices=[]):
        # The CPU generator only (the weights are drawn on the CPU): ``torch.manual_seed``
        # would also reseed every CUDA device, which ``fork_rng(devices=[])`` does not
        # restore, and without CUDA it records a stack trace per call (a third of the cost
        # of building the digits CNN, once per client call).
        torch.default_generator.manual_seed(seed)
        return factory(num_classes=num_classes, activation=activation)


def _build_user_model(
    reference: str, *, num_classes: int, activation: ActivationConfig | None, seed: int | None
) -> nn.Module:
    """A user's model: ``factory(num_classes=...)`` from ``package.module:factory``, seeded
    as the built-in ones are (every party builds the same round-0 weights)."""
    if activation is not None:
        raise ValueError(
            f"model={reference!r} with an activation: the activation applies to the built-in "
            "models only (a user's factory chooses its own)"
        )
    factory = plugins.load(reference, field="model")
    if not callable(factory):
        raise ValueError(f"model={reference!r}: expected a callable returning an nn.Module")
    _check_num_classes(num_classes)
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.default_generator.manual_seed(seed)
        model = factory(num_classes=num_classes)
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model={reference!r}: the factory returned {type(model).__name__}, expected an "
            "nn.Module"
        )
    return model


def model_input_shape(name: str) -> tuple[int, int, int] | None:
    """The ``C x H x W`` input the model takes: ``MODEL_INPUT_SHAPES`` for a built-in name,
    a user factory's ``input_shape`` attribute if it has one, else None (unknown)."""
    if plugins.is_reference(name):
        shape = getattr(plugins.load(name, field="model"), "input_shape", None)
        return None if shape is None else (int(shape[0]), int(shape[1]), int(shape[2]))
    return MODEL_INPUT_SHAPES[name]  # type: ignore[index]


def count_parameters(model: nn.Module, *, trainable_only: bool = True) -> int:
    """Number of scalar parameters in ``model`` (only those with ``requires_grad`` by default)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def _activation_factory(config: ActivationConfig | None) -> Callable[[], nn.Module]:
    return lambda: make_activation(config)


def _check_num_classes(num_classes: int) -> None:
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes={num_classes!r}: expected an integer >= 2")
