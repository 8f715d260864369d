"""Datasets: loading the standard ones (``datasets``), their file formats (``readers``) and
splitting across clients (``partition``). The package re-exports ``datasets``'s and
``readers``'s names.
"""

from fedsparse.common.data.datasets import (
    DATASET_INPUT_SHAPES,
    DATASET_NAMES,
    EVAL_SPLITS,
    MNIST_5K_FILE,
    NORMALIZATION,
    VALIDATION_FRACTION,
    DatasetName,
    EvalSplit,
    Split,
    dataset_files,
    dataset_input_shape,
    hold_out_validation,
    load_dataset,
    load_eval_splits,
)
from fedsparse.common.data.readers import (
    DatasetFormatError,
    read_idx,
    read_mnist_5k,
)

__all__ = [
    "DATASET_INPUT_SHAPES",
    "DATASET_NAMES",
    "MNIST_5K_FILE",
    "NORMALIZATION",
    "DatasetFormatError",
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
    "read_idx",
    "read_mnist_5k",
]
