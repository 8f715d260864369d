"""The federated run's configuration: one frozen dataclass built from Flower's run config.

``[tool.flwr.app.config]`` in ``pyproject.toml`` declares every key with its default; ``flwr
run --run-config`` and ``fedsparse simulate --set key=value`` override them. Both apps parse
the same mapping with ``FederatedConfig.from_run_config`` so server and clients agree, and a
bad value is rejected with the key's name and the value (``final-rate=1.2: expected 0 <= r <
1``). Pure Python: the mapping is a plain dict, no Flower import.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedsparse.common.dp import MECHANISMS
from fedsparse.common.payload import COMPRESSIONS, VALUE_DTYPES
from fedsparse.common.training import ACCOUNTANTS, PrivacyConfig, SparsityConfig

__all__ = ["CODECS", "MASK_SCOPES", "FederatedConfig", "wire_encoding"]

MASK_SCOPES = ("round", "client")
# How a sparse update's support travels (payload.py): "values" sends values only and lets the
# receiver regenerate the support from the broadcast seed; "coo", "delta" and "bitmap" send it
# explicitly (what a system without seed sharing pays); "auto" picks the smallest, which is
# "values" whenever a seed is known.
CODECS = ("values", "coo", "delta", "bitmap", "auto")


def wire_encoding(codec: str, *, sparse: bool) -> str:
    """The ``payload.encode_update`` encoding for a run-config ``codec``.

    A full update (``sparse=False``: rate 0, or the first dense download) always travels
    ``"dense"``: every codec agrees that no indices are needed.
    """
    if codec not in CODECS:
        raise ValueError(f"codec={codec!r}: expected one of {', '.join(CODECS)}")
    if not sparse:
        return "dense"
    return "seeded" if codec == "values" else codec


@dataclass(frozen=True, kw_only=True)
class FederatedConfig:
    """Every knob of a federated run (field ``x_y`` is run-config key ``x-y``)."""

    # federation
    num_rounds: int = 10
    clients_per_round: int = 0  # 0: every connected client
    min_clients: int = 2
    round_timeout: float = 600.0
    # local optimisation
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.5
    momentum: float = 0.0
    # privacy (target-epsilon > 0 calibrates sigma; else noise-multiplier is used)
    mechanism: str = "dpsgd"
    max_grad_norm: float = 1.0
    noise_multiplier: float = 0.0
    target_epsilon: float = 3.0
    delta: float = 1e-5
    accountant: str = "rdp"
    secure_mode: bool = False
    # sparsification
    final_rate: float = 0.7
    schedule: str = "gradual"
    cooling_rounds: int = 1
    initial_keep: float = 1.0
    final_keep: float = 1.0
    rate_steps: str = ""  # schedule=steps: comma-separated rates, e.g. "0,0.5,0.7,0.9"
    mask_scope: str = "round"
    # transport
    codec: str = "values"
    value_dtype: str = "fp32"
    compression: str = "none"
    # data and model
    dataset: str = "digits"
    data_dir: str = ""
    partitioner: str = "iid"
    dirichlet_alpha: float = 0.5
    model: str = ""
    seed: int = 0
    out_dir: str = ""

    def __post_init__(self) -> None:
        def fail(field: str, expected: str) -> None:
            key = field.replace("_", "-")
            raise ValueError(f"{key}={getattr(self, field)!r}: expected {expected}")

        for field in ("num_rounds", "local_epochs", "batch_size", "min_clients"):
            if getattr(self, field) < 1:
                fail(field, ">= 1")
        if self.clients_per_round < 0:
            fail("clients_per_round", ">= 0 (0 = all connected clients)")
        for field in ("round_timeout", "lr", "max_grad_norm"):
            value = getattr(self, field)
            if not (math.isfinite(value) and value > 0):
                fail(field, "a finite value > 0")
        if not 0.0 <= self.momentum < 1.0:
            fail("momentum", "0 <= momentum < 1")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            fail("noise_multiplier", "a finite value >= 0")
        if not (math.isfinite(self.target_epsilon) and self.target_epsilon >= 0):
            fail("target_epsilon", "a finite value >= 0 (0: use noise-multiplier)")
        if self.mechanism not in MECHANISMS:
            fail("mechanism", f"one of {', '.join(MECHANISMS)}")
        if self.accountant not in ACCOUNTANTS:
            fail("accountant", f"one of {', '.join(ACCOUNTANTS)}")
        if self.mask_scope not in MASK_SCOPES:
            fail("mask_scope", f"one of {', '.join(MASK_SCOPES)}")
        if self.codec not in CODECS:
            fail("codec", f"one of {', '.join(CODECS)}")
        if self.value_dtype not in VALUE_DTYPES:
            fail("value_dtype", f"one of {', '.join(VALUE_DTYPES)}")
        if self.compression not in COMPRESSIONS:
            fail("compression", f"one of {', '.join(COMPRESSIONS)}")
        if not 0 <= self.seed < 2**63:
            fail("seed", "0 <= seed < 2**63")
        if self.dirichlet_alpha <= 0:
            fail("dirichlet_alpha", "> 0")
        try:
            self.privacy()
            self.sparsity().rate_schedule(self.num_rounds)
        except ValueError as err:
            message = re.sub(r"(?<![\w-])steps=", "rate-steps=", str(err).replace("_", "-"))
            raise ValueError(message) from err

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> FederatedConfig:
        """Builds the config from Flower's run config (dashed keys); unknown keys are errors."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in run_config.items():
            name = key.replace("-", "_")
            if name not in fields:
                known = ", ".join(sorted(k.replace("_", "-") for k in fields))
                raise ValueError(f"run config key {key!r} is unknown; known keys: {known}")
            kwargs[name] = _coerce(key, value, type(fields[name].default))
        return cls(**kwargs)

    def to_run_config(self) -> dict[str, Any]:
        """The dashed-key mapping (what ``[tool.flwr.app.config]`` holds)."""
        return {k.replace("_", "-"): v for k, v in dataclasses.asdict(self).items()}

    def privacy(self) -> PrivacyConfig:
        """Local DP settings; target-epsilon > 0 wins over noise-multiplier."""
        use_target = self.mechanism == "dpsgd" and self.target_epsilon > 0
        return PrivacyConfig(
            mechanism=self.mechanism,
            noise_multiplier=None if use_target else self.noise_multiplier,
            target_epsilon=self.target_epsilon if use_target else None,
            delta=self.delta,
            max_grad_norm=self.max_grad_norm,
            accountant=self.accountant,
            secure_mode=self.secure_mode,
        )

    def sparsity(self) -> SparsityConfig:
        """The rate schedule over rounds (mask seeds come from the server each round)."""
        return SparsityConfig(
            schedule=self.schedule,
            final_rate=self.final_rate,
            cooling_steps=self.cooling_rounds,
            initial_keep=self.initial_keep,
            final_keep=self.final_keep,
            steps=self.steps(),
        )

    def steps(self) -> tuple[float, ...]:
        """``rate-steps`` parsed (empty when unset)."""
        try:
            return tuple(float(x) for x in self.rate_steps.split(",") if x.strip())
        except ValueError:
            raise ValueError(
                f"rate-steps={self.rate_steps!r}: expected comma-separated rates"
            ) from None


def _coerce(key: str, value: Any, kind: type) -> Any:
    """Converts a run-config value to the field's type, naming the key on failure."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise ValueError(f"{key}={value!r}: expected true or false")
    try:
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind is float:
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}={value!r}: expected {kind.__name__}") from None
