"""A bad value is refused before the heavy imports, with the words the full parse uses: the
value checks live in ``common/config_values.py`` (and the names in ``common/names.py``),
which import nothing heavy, and ``FederatedConfig`` runs the same function first. The speed
itself is measured in ``benchmarks/config_errors.py``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fedsparse.common.config import FederatedConfig
from fedsparse.common.methods.registry import METHOD_CLASSES
from fedsparse.common.names import METHOD_NAMES
from fedsparse.lab.cli.utils import check_grid_values, check_run_config

BAD = [
    {"final-rate": "1.5"},
    {"dataset": "digit"},
    {"lr": "0"},
    {"momentum": "1"},
    {"delta": "2"},
    {"model": "dpcnn"},  # a CIFAR model for digits' 8x8 images
    {"mechanism": "dp-sgd"},
    {"log": "tensorbord"},
    {"error-feedback": "true"},  # with fp32 values
    {"trim-fraction": "0.5"},
    {"nominal-size": "-1"},
    {"cooling-rounds": "0"},
    {"max-norm-ratio": "-1"},
    {"dp-level": "user"},
    {"secure-aggregation": "true"},
]


@pytest.mark.parametrize("overrides", BAD, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_a_bad_value_is_refused_fast_with_the_full_parses_words(overrides: dict) -> None:
    with pytest.raises(ValueError) as full:
        FederatedConfig.from_run_config(overrides)
    with pytest.raises(ValueError) as fast:
        check_run_config(overrides)
    assert str(fast.value) == str(full.value)


def test_a_setting_that_needs_others_names_them_all_in_its_first_error() -> None:
    with pytest.raises(ValueError) as err:
        check_run_config({"secure-aggregation": "true", "value-dtype": "int8"})
    message = str(err.value)
    for need in ("dp-level='user'", "clients-per-round >= 1", "value-dtype='fp32'"):
        assert need in message, message
    check_run_config(
        {"secure-aggregation": "true", "dp-level": "user", "clients-per-round": "3"}
    )  # with them: accepted


def test_every_grid_point_is_checked_as_a_whole() -> None:
    check_grid_values(["lr=0.1,0.5", "final-rate=0,0.9"], {})
    with pytest.raises(ValueError, match=r"final-rate=1\.2: expected 0 <= r < 1"):
        check_grid_values(["lr=0.1", "final-rate=0.5,1.2"], {})
    # values valid only together (each alone is refused) are accepted together
    check_grid_values(["dataset=cifar10", "model=cifar10-hcnn"], {})
    check_grid_values(["error-feedback=true", "value-dtype=int8"], {})
    check_grid_values(["dp-level=user", "clients-per-round=3"], {})
    check_grid_values(["stride=2,3"], {"method": "pkg.module:Method"})  # a plug-in's own key


def test_the_value_checks_import_nothing_heavy() -> None:
    code = (
        "import sys; import fedsparse.common.config_values, fedsparse.common.names, "
        "fedsparse.client.node_policy, fedsparse.client.node_data, fedsparse.lab.cli.utils; "
        "heavy = [m for m in ('torch', 'numpy', 'opacus', 'flwr') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_the_method_names_are_the_built_in_methods() -> None:
    assert tuple(METHOD_CLASSES) == METHOD_NAMES
