"""The image classifiers (``classifiers``) and the scattering front end of the H-CNNs
(``scattering``). The package re-exports ``classifiers``'s names.
"""

from fedsparse.common.models.classifiers import (
    DEFAULT_MODELS,
    DPCNN,
    HCNN,
    MODEL_INPUT_SHAPES,
    MODEL_NAMES,
    ActivationConfig,
    DigitsCNN,
    DPCNNMnist,
    HCNNMnist,
    ModelName,
    TemperedSigmoid,
    build_model,
    count_parameters,
    make_activation,
    model_input_shape,
)

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
