"""The dataset file formats, read and checked: IDX, the mnist-5k CSV, CIFAR-10 pickles, SVHN .mat.

Each reader takes one file and returns its images as uint8 ``N x C x H x W`` (or ``N x H x W``
for IDX) and its labels as int64, in file order. Files are a trust boundary: every header,
shape, dtype and label range is checked, and a bad file raises :class:`DatasetFormatError`
naming the file. CIFAR pickles are read with an unpickler that only allows the numpy array
reconstructors, so a malicious pickle cannot run code. Which files a dataset needs, and how its
splits are assembled and normalized, is ``datasets``'s.
"""

from __future__ import annotations

import codecs
import gzip
import io
import pickle
import struct
from pathlib import Path
from typing import Any, Final

import numpy as np

__all__ = [
    "IDX_IMAGES_MAGIC",
    "IDX_LABELS_MAGIC",
    "DatasetFormatError",
    "read_idx",
    "read_mnist_5k",
]

IDX_IMAGES_MAGIC: Final = 0x00000803  # unsigned bytes, 3 dimensions
IDX_LABELS_MAGIC: Final = 0x00000801  # unsigned bytes, 1 dimension

_NUM_CLASSES: Final = 10

_MNIST_5K_ROWS: Final = 5000
_MNIST_5K_PER_CLASS: Final = 500


class DatasetFormatError(ValueError):
    """A dataset file exists but is corrupt, truncated or not in the expected format."""


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


def read_mnist_5k(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Parse ``mnist_5k.csv.gz`` (raw or gzip-compressed by ``.gz`` suffix).

    Each of the 5,000 rows holds 784 pixel values (0..255, the 28x28 image row-major) and
    then the label; each digit 0..9 has 500 rows.

    Args:
        path: The file.

    Returns:
        ``(images, labels)``: uint8 ``5000 x 1 x 28 x 28`` and int64 ``5000``, in file order.

    Raises:
        DatasetFormatError: Not gzip, not a CSV of numbers, a row of the wrong length, a
            pixel outside 0..255 or not an integer, a label outside 0..9, or not 500 rows of
            each digit; the message names the file.
    """
    try:
        text = _read_bytes(path).decode("ascii")
        if not text.strip():
            raise ValueError("the file is empty")
        table = np.loadtxt(io.StringIO(text), delimiter=",", dtype=np.float64, ndmin=2)
    except ValueError as e:  # UnicodeDecodeError, ragged rows and non-numbers alike
        raise DatasetFormatError(f"{path}: not a CSV table of numbers ({e})") from e
    expected = (_MNIST_5K_ROWS, 28 * 28 + 1)
    if table.shape != expected:
        raise DatasetFormatError(
            f"{path}: table is {table.shape[0]} x {table.shape[1]}, expected "
            f"{expected[0]} x {expected[1]} (784 pixels and a label per row)"
        )
    if not (np.isfinite(table).all() and (table == np.round(table)).all()):
        raise DatasetFormatError(f"{path}: values must be integers")
    pixels, labels = table[:, :-1], table[:, -1].astype(np.int64)
    if pixels.min() < 0 or pixels.max() > 255:
        raise DatasetFormatError(
            f"{path}: pixels span [{pixels.min():g}, {pixels.max():g}], expected 0..255"
        )
    _check_labels(labels, path)
    counts = np.bincount(labels, minlength=_NUM_CLASSES)
    if (counts != _MNIST_5K_PER_CLASS).any():
        raise DatasetFormatError(
            f"{path}: class counts {counts.tolist()}, expected {_MNIST_5K_PER_CLASS} of each digit"
        )
    return pixels.astype(np.uint8).reshape(-1, 1, 28, 28), labels


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


def _check_labels(labels: np.ndarray, path: Path) -> None:
    if labels.size and (labels.min() < 0 or labels.max() >= _NUM_CLASSES):
        raise DatasetFormatError(
            f"{path}: labels span [{labels.min()}, {labels.max()}], expected 0..{_NUM_CLASSES - 1}"
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
