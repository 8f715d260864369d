"""Every name a run-config key accepts, in one module that imports nothing heavy.

The vocabularies (``Literal`` types and their tuples) of the concepts a run config names --
datasets, models, partitioners, DP mechanisms, engines and accountants, schedules, methods,
codecs and value dtypes, aggregators -- and the input shapes that tie a model to a dataset.
The modules that implement each concept re-use these (``common/data/datasets.py`` takes
``DatasetName`` from here, and so on), so a name is defined once, and a run config's values
can be checked (``common/config_values.py``) in milliseconds, before torch or Opacus is
imported. Pure Python.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

__all__ = [
    "ACCOUNTANTS",
    "AGGREGATORS",
    "CENTRAL_NOISE_SOURCES",
    "CODECS",
    "COMPRESSIONS",
    "DATASET_INPUT_SHAPES",
    "DATASET_NAMES",
    "DEFAULT_MODELS",
    "DEVICES",
    "DP_LEVELS",
    "DP_NORM_BOUNDS",
    "ENGINES",
    "EVAL_SPLITS",
    "LOWBIT_DTYPES",
    "MASK_SCOPES",
    "MECHANISMS",
    "METHOD_NAMES",
    "MODEL_INPUT_SHAPES",
    "MODEL_NAMES",
    "NORM_ACTIONS",
    "PARTITIONER_NAMES",
    "PER_STEP_METHODS",
    "PAYLOAD_DTYPES",
    "SCHEDULES",
    "SELECTIONS",
    "SELECTION_MODES",
    "TRACKERS",
    "VALUE_DTYPES",
    "WEIGHTINGS",
    "AccountantName",
    "AggregatorName",
    "CentralNoise",
    "CodecName",
    "Compression",
    "DPLevel",
    "DPNormBound",
    "DatasetName",
    "DeviceName",
    "EngineName",
    "EvalSplit",
    "FederatedMethodName",
    "LowBitDType",
    "MaskScope",
    "MechanismName",
    "MethodName",
    "ModelName",
    "NormAction",
    "PartitionerName",
    "PayloadDType",
    "ScheduleName",
    "SelectionMode",
    "SelectionName",
    "TrackerName",
    "ValueDType",
    "Weighting",
]

# --- data and model ---------------------------------------------------------------------------

DatasetName = Literal["digits", "mnist", "fmnist", "cifar10", "svhn", "mnist-5k"]
"""Names accepted by ``load_dataset``; ``"digits"`` and ``"mnist-5k"`` need no ``data_dir``."""
DATASET_NAMES: Final[tuple[DatasetName, ...]] = get_args(DatasetName)
DATASET_INPUT_SHAPES: Final[dict[DatasetName, tuple[int, int, int]]] = {
    "digits": (1, 8, 8),
    "mnist": (1, 28, 28),
    "fmnist": (1, 28, 28),
    "cifar10": (3, 32, 32),
    "svhn": (3, 32, 32),
    "mnist-5k": (1, 28, 28),
}
"""``C x H x W`` of one image of each dataset (every one has 10 classes)."""

EvalSplit = Literal["test", "validation"]
"""What a run evaluates on: the test split, or a validation slice of its training split."""
EVAL_SPLITS: Final[tuple[EvalSplit, ...]] = get_args(EvalSplit)

PartitionerName = Literal["iid", "dirichlet", "shard", "pathological"]
PARTITIONER_NAMES: Final[tuple[PartitionerName, ...]] = get_args(PartitionerName)

ModelName = Literal["dpcnn", "dpcnn-mnist", "digits-cnn", "cifar10-hcnn", "mnist-hcnn"]
"""Names accepted by ``build_model``."""
MODEL_NAMES: Final[tuple[ModelName, ...]] = get_args(ModelName)
MODEL_INPUT_SHAPES: Final[dict[ModelName, tuple[int, int, int]]] = {
    "dpcnn": (3, 32, 32),
    "dpcnn-mnist": (1, 28, 28),
    "digits-cnn": (1, 8, 8),
    "cifar10-hcnn": (3, 32, 32),
    "mnist-hcnn": (1, 28, 28),
}
"""The ``C x H x W`` input each model takes (its linear head fixes the spatial size)."""
DEFAULT_MODELS: Final[dict[DatasetName, ModelName]] = {
    "digits": "digits-cnn",
    "mnist": "dpcnn-mnist",
    "fmnist": "dpcnn-mnist",
    "mnist-5k": "dpcnn-mnist",
    "cifar10": "dpcnn",
    "svhn": "dpcnn",
}
"""The model each dataset uses unless one is named."""

# --- privacy ----------------------------------------------------------------------------------

MechanismName = Literal["dpsgd", "clipped", "noisy"]
MECHANISMS: Final[tuple[MechanismName, ...]] = get_args(MechanismName)
AccountantName = Literal["rdp", "prv", "gdp"]
ACCOUNTANTS: Final[tuple[AccountantName, ...]] = get_args(AccountantName)
EngineName = Literal["auto", "opacus", "func", "factored"]
ENGINES: Final[tuple[EngineName, ...]] = get_args(EngineName)
DeviceName = Literal["auto", "cpu", "cuda"]
DEVICES: Final[tuple[DeviceName, ...]] = get_args(DeviceName)
DPLevel = Literal["sample", "user"]
DP_LEVELS: Final[tuple[DPLevel, ...]] = get_args(DPLevel)
CentralNoise = Literal["fresh", "seeded"]
CENTRAL_NOISE_SOURCES: Final[tuple[CentralNoise, ...]] = get_args(CentralNoise)

# --- sparsification and methods -----------------------------------------------------------------

ScheduleName = Literal["gradual", "cooling", "constant", "linear-keep", "exp-keep", "steps"]
SCHEDULES: Final[tuple[ScheduleName, ...]] = get_args(ScheduleName)
MethodName = Literal["rs", "random-freeze", "lf", "ranked", "dpssgd", "gip", "random-k"]
FederatedMethodName = Literal["rs", "random-freeze", "lf", "ranked", "dpssgd", "gip", "random-k"]
METHOD_NAMES: Final[tuple[FederatedMethodName, ...]] = get_args(FederatedMethodName)
#: The built-in methods whose clients choose each step's support (``Method.selects_per_step``).
PER_STEP_METHODS: Final[tuple[FederatedMethodName, ...]] = ("gip", "random-k")
SelectionMode = Literal["freeze", "reselect"]
SELECTION_MODES: Final[tuple[SelectionMode, ...]] = get_args(SelectionMode)
SelectionName = Literal["magnitude", "random"]
SELECTIONS: Final[tuple[SelectionName, ...]] = get_args(SelectionName)
MaskScope = Literal["round", "client"]
MASK_SCOPES: Final[tuple[MaskScope, ...]] = get_args(MaskScope)

# --- transport --------------------------------------------------------------------------------

CodecName = Literal["values", "coo", "delta", "bitmap", "auto"]
"""How a sparse update's support travels (payload): "values" sends values only and lets the
server regenerate the mask from the seed; the others send the indices too."""
CODECS: Final[tuple[CodecName, ...]] = get_args(CodecName)
ValueDType = Literal["fp32", "fp16", "bf16", "int8"]
"""The deterministic value dtypes."""
LowBitDType = Literal["int4", "int2", "int1"]
"""The blocked low-bit dtypes: stochastic rounding, so encoding them needs a generator."""
PayloadDType = Literal[ValueDType, LowBitDType]
"""How each value travels; every one decodes to float32."""
VALUE_DTYPES: Final[tuple[ValueDType, ...]] = get_args(ValueDType)
LOWBIT_DTYPES: Final[tuple[LowBitDType, ...]] = get_args(LowBitDType)
PAYLOAD_DTYPES: Final[tuple[PayloadDType, ...]] = (*VALUE_DTYPES, *LOWBIT_DTYPES)
Compression = Literal["none", "zstd"]
"""Optional compression of the ``indices`` and ``values`` sections."""
COMPRESSIONS: Final[tuple[Compression, ...]] = get_args(Compression)

# --- aggregation and records ------------------------------------------------------------------

AggregatorName = Literal["mean", "trimmed-mean", "median"]
AGGREGATORS: Final[tuple[AggregatorName, ...]] = get_args(AggregatorName)
Weighting = Literal["uniform", "examples"]
WEIGHTINGS: Final[tuple[Weighting, ...]] = get_args(Weighting)
NormAction = Literal["reject", "clip"]
"""What happens to an update above the norm bound: dropped, or scaled down to the bound."""
NORM_ACTIONS: Final[tuple[NormAction, ...]] = get_args(NormAction)
DPNormBound = Literal["auto", "off"]
"""Run-config ``dp-norm-bound``: "auto" bounds every update by what an honest client's DP
parameters allow wherever they bound it; "off" does not."""
DP_NORM_BOUNDS: Final[tuple[DPNormBound, ...]] = get_args(DPNormBound)
TrackerName = Literal["tensorboard", "mlflow"]
TRACKERS: Final[tuple[TrackerName, ...]] = get_args(TrackerName)
