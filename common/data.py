"""Image classification datasets as normalized in-memory tensors, read from standard files.

``load_dataset(name, data_dir=..., seed=...)`` returns ``(train, test)`` :class:`Split` pairs
with ``x`` float32 ``N x C x H x W`` (per-channel standardized) and ``y`` int64 ``N``.

Supported datasets and the files each needs (nothing is downloaded, ever):

* ``"digits"``: embedded (scikit-learn's 8x8 digits, 1,797 images); needs no files.
* ``"mnist"`` / ``"fmnist"``: the four IDX files ``train-images-idx3-ubyte``,
  ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each raw
  or ``.gz``, in ``data_dir`` or in torchvision's ``data_dir/MNIST/raw`` /
  ``data_dir/FashionMNIST/raw``.
* ``"cifar10"``: the python pickles ``data_batch_1`` .. ``data_batch_5`` and ``test_batch``, in
  ``data_dir`` or ``data_dir/cifar-10-batches-py``.
* ``"svhn"``: ``train_32x32.mat`` and ``test_32x32.mat`` (cropped digits, format 2), in
  ``data_dir``.

Files are a trust boundary: every header, shape, dtype and label range is checked, and a bad
file raises :class:`DatasetFormatError` naming the file. CIFAR pickles are read with an
unpickler that only allows the numpy array reconstructors, so a malicious pickle cannot run
code.
"""

from __future__ import annotations

import codecs
import gzip
import os
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, get_args

import numpy as np
import torch

__all__ = [
    "DATASET_INPUT_SHAPES",
    "DATASET_NAMES",
    "NORMALIZATION",
    "DatasetFormatError",
    "DatasetName",
    "Split",
    "load_dataset",
    "read_idx",
]

DatasetName = Literal["digits", "mnist", "fmnist", "cifar10", "svhn"]
"""Names accepted by :func:`load_dataset`; only ``"digits"`` needs no ``data_dir``."""

DATASET_NAMES: Final[tuple[DatasetName, ...]] = get_args(DatasetName)

DATASET_INPUT_SHAPES: Final[dict[DatasetName, tuple[int, int, int]]] = {
    "digits": (1, 8, 8),
    "mnist": (1, 28, 28),
    "fmnist": (1, 28, 28),
    "cifar10": (3, 32, 32),
    "svhn": (3, 32, 32),
}
"""``C x H x W`` of one image of each dataset (every one has 10 classes)."""

NORMALIZATION: Final[dict[str, tuple[tuple[float, ...], tuple[float, ...]]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fmnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
}
"""Per-channel ``(mean, std)`` of pixel values in ``[0, 1]``, applied as ``(x - mean) / std``.
Digits is standardized with its own training-split mean/std instead."""

IDX_IMAGES_MAGIC: Final = 0x00000803  # unsigned bytes, 3 dimensions
IDX_LABELS_MAGIC: Final = 0x00000801  # unsigned bytes, 1 dimension

_MNIST_FILES: Final = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_MNIST_SUBDIRS: Final = {"mnist": "MNIST/raw", "fmnist": "FashionMNIST/raw"}
_CIFAR_TRAIN_FILES: Final = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR_FILES: Final = (*_CIFAR_TRAIN_FILES, "test_batch")
_SVHN_FILES: Final = ("train_32x32.mat", "test_32x32.mat")
_NUM_CLASSES: Final = 10
_DIGITS_TEST_FRACTION: Final = 0.2


class DatasetFormatError(ValueError):
    """A dataset file exists but is corrupt, truncated or not in the expected format."""


@dataclass(frozen=True, kw_only=True, eq=False)
class Split:
    """One split of a labelled image dataset, held in memory.

    Attributes:
        x: float32 images, ``N x C x H x W``, already normalized.
        y: int64 class labels, ``N``.
    """

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if self.x.dtype != torch.float32 or self.x.dim() != 4:
            raise ValueError(
                f"x: expected a float32 N x C x H x W tensor, got {self.x.dtype} "
                f"with shape {tuple(self.x.shape)}"
            )
        if self.y.dtype != torch.int64 or self.y.dim() != 1:
            raise ValueError(
                f"y: expected an int64 1-D tensor, got {self.y.dtype} "
                f"with shape {tuple(self.y.shape)}"
            )
        if len(self.x) != len(self.y):
            raise ValueError(f"x has {len(self.x)} examples but y has {len(self.y)} labels")

    def __len__(self) -> int:
        return len(self.y)


def load_dataset(
    name: DatasetName, *, data_dir: str | os.PathLike[str] | None = None, seed: int = 0
) -> tuple[Split, Split]:
    """Load a dataset's train and test splits as normalized tensors.

    Args:
        name: One of :data:`DATASET_NAMES`.
        data_dir: Directory holding the dataset's files (see the module docstring for the
            layout); ignored for ``"digits"``, required for the others.
        seed: Seed of the stratified 80/20 train/test split of ``"digits"`` (the other
            datasets come with a fixed split, and ignore it).

    Returns:
        ``(train, test)``.

    Raises:
        ValueError: Unknown ``name``, or ``data_dir`` is None for a non-embedded dataset.
        FileNotFoundError: The files are missing; the message names the dataset, the
            directories searched and the expected file names.
        DatasetFormatError: A file is corrupt, truncated or has unexpected contents.
    """
    if name not in DATASET_NAMES:
        raise ValueError(f"dataset name={name!r}: expected one of {', '.join(DATASET_NAMES)}")
    if name == "digits":
        return _load_digits(seed=seed)
    if data_dir is None:
        raise ValueError(
            f"data_dir=None: dataset {name!r} is not embedded; pass data_dir, the directory "
            "holding its files (only 'digits' needs none)"
        )
    root = Path(data_dir)
    if name in _MNIST_SUBDIRS:
        return _load_mnist_like(name, root)
    if name == "cifar10":
        return _load_cifar10(root)
    return _load_svhn(root)


def read_idx(path: Path, *, expected_magic: int) -> np.ndarray:
    """Parse an IDX file (LeCun's MNIST format), raw or gzip-compressed by ``.gz`` suffix.

    Layout: big-endian int32 magic ``0x000008NN`` (``08`` = unsigned byte, ``NN`` = number of
    dimensions), then ``NN`` big-endian int32 dimension sizes, then the data.

    Args:
        path: The file.
        expected_magic: :data:`IDX_IMAGES_MAGIC` or :data:`IDX_LABELS_MAGIC`.

    Returns:
        A writable uint8 array with the header's dimensions.

    Raises:
        DatasetFormatError: Bad magic number, short header, or payload size not matching
            the dimensions (truncated or trailing bytes); the message names the file.
    """
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise DatasetFormatError(f"{path}: {len(raw)} bytes, too short for an IDX header")
    (magic,) = struct.unpack(">i", raw[:4])
    if magic != expected_magic:
        raise DatasetFormatError(
            f"{path}: IDX magic number 0x{magic & 0xFFFFFFFF:08x}, expected 0x{expected_magic:08x}"
        )
    ndim = magic & 0xFF
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise DatasetFormatError(
            f"{path}: truncated IDX header ({len(raw)} bytes, expected {header_len})"
        )
    dims = struct.unpack(f">{ndim}i", raw[4:header_len])
    expected = int(np.prod(dims, dtype=np.int64))
    payload = len(raw) - header_len
    if payload != expected:
        raise DatasetFormatError(
            f"{path}: IDX payload is {payload} bytes but dimensions {dims} need {expected} "
            "(truncated or corrupt file)"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header_len).reshape(dims).copy()


def _read_bytes(path: Path) -> bytes:
    if path.suffix != ".gz":
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise DatasetFormatError(f"{path}: not a valid gzip file ({e})") from e


def _load_digits(*, seed: int) -> tuple[Split, Split]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x_all, y_all = load_digits(return_X_y=True)
    x_all = (np.asarray(x_all, dtype=np.float64) / 16.0).reshape(-1, 1, 8, 8)
    x_train, x_test, y_train, y_test = train_test_split(
        x_all, y_all, test_size=_DIGITS_TEST_FRACTION, stratify=y_all, random_state=seed
    )
    mean, std = float(x_train.mean()), float(x_train.std())
    return (
        _make_split((x_train - mean) / std, y_train),
        _make_split((x_test - mean) / std, y_test),
    )


def _load_mnist_like(name: str, root: Path) -> tuple[Split, Split]:
    dirs = [root, root / _MNIST_SUBDIRS[name]]
    paths = _find_files(name, dirs, _MNIST_FILES, allow_gz=True)
    splits = []
    for prefix in ("train", "t10k"):
        images_path = paths[f"{prefix}-images-idx3-ubyte"]
        labels_path = paths[f"{prefix}-labels-idx1-ubyte"]
        images = read_idx(images_path, expected_magic=IDX_IMAGES_MAGIC)
        labels = read_idx(labels_path, expected_magic=IDX_LABELS_MAGIC)
        if images.shape[1:] != (28, 28):
            raise DatasetFormatError(
                f"{images_path}: images are {images.shape[1]}x{images.shape[2]}, expected 28x28"
            )
        if len(labels) != len(images):
            raise DatasetFormatError(
                f"{labels_path}: {len(labels)} labels but {images_path} has {len(images)} images"
            )
        _check_labels(labels, labels_path)
        splits.append(_normalized_split(name, images[:, None, :, :], labels))
    return splits[0], splits[1]


def _load_cifar10(root: Path) -> tuple[Split, Split]:
    paths = _find_files(
        "cifar10", [root, root / "cifar-10-batches-py"], _CIFAR_FILES, allow_gz=False
    )
    batches = {name: _read_cifar_batch(paths[name]) for name in _CIFAR_FILES}
    train_x = np.concatenate([batches[n][0] for n in _CIFAR_TRAIN_FILES])
    train_y = np.concatenate([batches[n][1] for n in _CIFAR_TRAIN_FILES])
    test_x, test_y = batches["test_batch"]
    return (
        _normalized_split("cifar10", train_x, train_y),
        _normalized_split("cifar10", test_x, test_y),
    )


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Read one CIFAR-10 batch: ``{b"data": uint8 N x 3072, b"labels": N ints}``."""
    try:
        with path.open("rb") as f:
            batch = _NumpyOnlyUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise DatasetFormatError(f"{path}: not a readable CIFAR-10 pickle ({e})") from e
    if not isinstance(batch, dict):
        raise DatasetFormatError(f"{path}: expected a pickled dict, got {type(batch).__name__}")
    for key in (b"data", b"labels"):
        if key not in batch:
            raise DatasetFormatError(f"{path}: missing key {key!r}")
    data = batch[b"data"]
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2):
        raise DatasetFormatError(f"{path}: b'data' must be a 2-D uint8 array")
    if data.shape[1] != 3 * 32 * 32:
        raise DatasetFormatError(f"{path}: b'data' has shape {data.shape}, expected (N, 3072)")
    try:
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except (TypeError, ValueError) as e:
        raise DatasetFormatError(f"{path}: b'labels' is not a list of integers") from e
    if labels.shape != (len(data),):
        raise DatasetFormatError(
            f"{path}: b'labels' has shape {labels.shape}, expected ({len(data)},)"
        )
    _check_labels(labels, path)
    # Each row is the red, green then blue 32x32 planes, row-major: reshape is NCHW already.
    return data.reshape(-1, 3, 32, 32), labels


def _load_svhn(root: Path) -> tuple[Split, Split]:
    paths = _find_files("svhn", [root], _SVHN_FILES, allow_gz=False)
    splits = [_read_svhn_mat(paths[name]) for name in _SVHN_FILES]
    return (
        _normalized_split("svhn", *splits[0]),
        _normalized_split("svhn", *splits[1]),
    )


def _read_svhn_mat(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Read ``{X: uint8 32 x 32 x 3 x N, y: N x 1 in 1..10}``; label 10 is the digit 0."""
    from scipy.io import loadmat

    try:
        mat = loadmat(path)
    except Exception as e:  # scipy raises a zoo of types on corrupt files
        raise DatasetFormatError(f"{path}: not a readable MATLAB file ({e})") from e
    for key in ("X", "y"):
        if key not in mat:
            raise DatasetFormatError(f"{path}: missing variable {key!r}")
    x, y = mat["X"], mat["y"]
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[:3] != (32, 32, 3):
        raise DatasetFormatError(
            f"{path}: X is {x.dtype} with shape {x.shape}, expected uint8 (32, 32, 3, N)"
        )
    n = x.shape[3]
    if y.shape not in ((n, 1), (n,)):
        raise DatasetFormatError(f"{path}: y has shape {y.shape}, expected ({n}, 1)")
    labels = y.reshape(-1).astype(np.int64)
    if labels.size and (labels.min() < 1 or labels.max() > 10):
        raise DatasetFormatError(
            f"{path}: labels span [{labels.min()}, {labels.max()}], expected 1..10"
        )
    return np.ascontiguousarray(x.transpose(3, 2, 0, 1)), labels % 10


def _find_files(
    dataset: str, dirs: list[Path], names: tuple[str, ...], *, allow_gz: bool
) -> dict[str, Path]:
    """Return the first directory's paths for all ``names`` (raw preferred over ``.gz``)."""
    for directory in dirs:
        found: dict[str, Path] = {}
        for name in names:
            candidates = [directory / name] + ([directory / f"{name}.gz"] if allow_gz else [])
            path = next((p for p in candidates if p.is_file()), None)
            if path is not None:
                found[name] = path
        if len(found) == len(names):
            return found
    gz_note = " (each raw or .gz)" if allow_gz else ""
    raise FileNotFoundError(
        f"dataset {dataset!r}: expected files {', '.join(names)}{gz_note} together in one of "
        f"the directories {', '.join(str(d) for d in dirs)}; not found"
    )


def _check_labels(labels: np.ndarray, path: Path) -> None:
    if labels.size and (labels.min() < 0 or labels.max() >= _NUM_CLASSES):
        raise DatasetFormatError(
            f"{path}: labels span [{labels.min()}, {labels.max()}], expected 0..{_NUM_CLASSES - 1}"
        )


def _normalized_split(name: str, images: np.ndarray, labels: np.ndarray) -> Split:
    """Scale uint8 NCHW ``images`` to [0, 1] and standardize with ``NORMALIZATION[name]``."""
    mean, std = NORMALIZATION[name]
    x = torch.from_numpy(np.ascontiguousarray(images)).to(torch.float32).div_(255.0)
    x.sub_(torch.tensor(mean).view(1, -1, 1, 1)).div_(torch.tensor(std).view(1, -1, 1, 1))
    return Split(x=x, y=torch.from_numpy(labels.astype(np.int64)))


def _make_split(x: np.ndarray, y: np.ndarray) -> Split:
    return Split(
        x=torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
        y=torch.from_numpy(np.asarray(y, dtype=np.int64)),
    )


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the globals a CIFAR-10 batch needs (numpy arrays)."""

    _ALLOWED: Final[dict[tuple[str, str], Any]] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        # The reconstructor lives in numpy.core (numpy 1, the original CIFAR pickles) or
        # numpy._core (numpy 2); resolve both to the running numpy's function.
        ("numpy.core.multiarray", "_reconstruct"): np.zeros(0).__reduce__()[0],
        ("numpy._core.multiarray", "_reconstruct"): np.zeros(0).__reduce__()[0],
        ("numpy.core.multiarray", "scalar"): np.int64(0).__reduce__()[0],
        ("numpy._core.multiarray", "scalar"): np.int64(0).__reduce__()[0],
        # Python 3 pickles bytes as _codecs.encode(str, "latin1") under protocol < 3.
        ("_codecs", "encode"): codecs.encode,
    }

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name} (only numpy arrays are allowed)"
            ) from None
