"""The federated run's configuration: one frozen dataclass built from Flower's run config.

``[tool.flwr.app.config]`` in ``pyproject.toml`` declares every key with its default; ``flwr
run --run-config`` and ``fedsparse simulate --set key=value`` override them. Both apps parse
the same mapping with ``FederatedConfig.from_run_config`` so server and clients agree, and a
bad value is rejected with the key's name and the value (``final-rate=1.2: expected 0 <= r <
1``), names included (``dataset='imagenet': expected one of digits, ...``): a typo fails at
parse time, not half a minute later inside Flower. The allowed names are the ``Literal`` types
of the modules that implement them (``data.DatasetName``, ``models.ModelName``, ...). Pure
Python: the mapping is a plain dict, no Flower import.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

from fedsparse.common import plugins
from fedsparse.common.aggregation.norm_bounds import (
    DP_NORM_BOUNDS,
    NORM_ACTIONS,
    DPNormBound,
    HonestClientBound,
    NormAction,
    NormBound,
    worst_case_noise_multiplier,
)
from fedsparse.common.aggregation.sparse import AGGREGATORS, WEIGHTINGS, AggregatorName, Weighting
from fedsparse.common.coerce import coerce, unknown_key
from fedsparse.common.data.datasets import (
    DATASET_INPUT_SHAPES,
    DATASET_NAMES,
    EVAL_SPLITS,
    DatasetName,
    EvalSplit,
)
from fedsparse.common.data.partition import PARTITIONER_NAMES, PartitionerName
from fedsparse.common.dp.accounting import ACCOUNTANTS, AccountantName
from fedsparse.common.dp.central import CENTRAL_NOISE_SOURCES, DP_LEVELS, CentralNoise, DPLevel
from fedsparse.common.dp.engines import ENGINES, EngineName
from fedsparse.common.dp.optimizer import MECHANISMS, MechanismName
from fedsparse.common.methods import (
    SELECTION_MODES,
    SELECTIONS,
    FederatedMethodName,
    Method,
    MethodConfig,
    SelectionMode,
    SelectionName,
    check_method_name,
    method_class,
    method_schedule,
)
from fedsparse.common.methods.index_selection import DEFAULT_INDEX_FRACTION
from fedsparse.common.methods.schedules import SCHEDULES, ScheduleName
from fedsparse.common.models.classifiers import (
    DEFAULT_MODELS,
    MODEL_INPUT_SHAPES,
    MODEL_NAMES,
    ModelName,
)
from fedsparse.common.training.local import DEVICES, DeviceName, PrivacyConfig, SparsityConfig
from fedsparse.common.wire.payload import (
    COMPRESSIONS,
    DEFAULT_VALUE_BLOCK,
    PAYLOAD_DTYPES,
    Compression,
    IndexEncoding,
    PayloadDType,
)
from fedsparse.common.wire.protocol import MASK_SCOPES, MaskScope

__all__ = [
    "ADDED_KEYS",
    "CODECS",
    "RESUME_MAY_DIFFER",
    "TRACKERS",
    "MASK_SCOPES",
    "with_added_keys",
    "CodecName",
    "FederatedConfig",
    "MaskScope",
    "run_config_fields",
    "wire_encoding",
]

CodecName = Literal["values", "coo", "delta", "bitmap", "auto"]
"""How a sparse update's support travels (payload): "values" sends values only and lets the
receiver regenerate the support from the broadcast seed; "coo", "delta" and "bitmap" send it
explicitly (what a system without seed sharing pays); "auto" picks the smallest, which is
"values" whenever a seed is known."""

CODECS: Final[tuple[CodecName, ...]] = get_args(CodecName)


#: Run-config keys a resumed run may set differently from the run it continues: none of them
#: changes a number the run computes (where records go and how long the server waits). Every
#: other key, ``num-rounds`` included (the rate schedule and a calibrated sigma depend on it),
#: must equal the checkpoint's.
RESUME_MAY_DIFFER: Final[frozenset[str]] = frozenset(
    {"resume", "out-dir", "data-dir", "round-timeout", "min-clients", "save-updates", "log"}
)

#: Run-config keys added after runs were recorded, with the value under which a run recorded
#: before them ran: ``auto`` was the Opacus engine on the CPU when those runs ran (it is the
#: factored engine since 2026-11-25: the same mechanism, equal to float rounding, so a run or
#: checkpoint recorded under the old ``auto`` is read as the same config; ``engine=opacus``
#: repeats it bit for bit), and ``method=rs`` (with its unused ``freeze-*`` defaults) is what
#: every earlier run did. A checkpoint or a finished sweep run written without them is read
#: through ``with_added_keys``.
ADDED_KEYS: Final[dict[str, Any]] = {
    "log": "",
    "engine": "auto",
    "device": "auto",
    "method": "rs",
    "freeze-layers": 1,
    "freeze-after": 0,
    "public-fraction": 0.1,
    "public-epochs": 5,
    "selection": "magnitude",
    "selection-mode": "freeze",
    "index-budget-fraction": DEFAULT_INDEX_FRACTION,
    "group-size": 256,
    "eval-split": "test",
    "split-seed": -1,
    "dp-level": "sample",
    "central-noise-multiplier": 1.0,
    "central-clip": 1.0,
    "central-noise": "fresh",
    # The bound never binds on an honest update (common/aggregation/robust.py: HonestClientBound,
    # with
    # probability 1 - 1e-9 per update), so a run recorded without it is what it would have
    # recorded with it, bit for bit, unless a client sent what no honest client can.
    "dp-norm-bound": "auto",
    "max-client-examples": 0,
    # Only the low-bit value dtypes (added with it) read it: an earlier run ran at any value.
    "value-block": DEFAULT_VALUE_BLOCK,
}


def with_added_keys(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (a saved run config) with the keys it predates at their ``ADDED_KEYS`` value."""
    return {**ADDED_KEYS, **config}


def wire_encoding(codec: CodecName, *, sparse: bool) -> IndexEncoding:
    """The ``payload.encode_update`` encoding for a run-config ``codec``.

    A full update (``sparse=False``: rate 0, or the first dense download) always travels
    ``"dense"``: every codec agrees that no indices are needed.
    """
    if codec not in CODECS:
        raise ValueError(f"codec={codec!r}: expected one of {', '.join(CODECS)}")
    if not sparse:
        return "dense"
    if codec == "values":
        return "seeded"
    return codec


#: Experiment trackers a run can log to (``log``; ``server/tracking.py``).
TRACKERS: Final = ("tensorboard", "mlflow")

#: The ``FederatedConfig`` field that is not a run-config key (a plug-in's own keys travel as
#: top-level keys of their own).
_NOT_A_KEY: Final = "method_options"


def run_config_fields() -> list[dataclasses.Field[Any]]:
    """The ``FederatedConfig`` fields that are run-config keys (``[tool.flwr.app.config]``),
    in order: every field but ``method_options``."""
    return [f for f in dataclasses.fields(FederatedConfig) if f.name != _NOT_A_KEY]


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
    lr: float = 0.25
    momentum: float = 0.0
    # local performance: the DP engine ("auto": func on CUDA, else factored) and the device
    # ("auto": CUDA if the client has one). Checked for availability where training runs, not
    # here: the server parses this config too and needs no GPU.
    engine: EngineName = "auto"
    device: DeviceName = "auto"
    # privacy (target-epsilon > 0 calibrates sigma; else noise-multiplier is used)
    mechanism: MechanismName = "dpsgd"
    max_grad_norm: float = 1.0
    noise_multiplier: float = 0.0
    target_epsilon: float = 3.0
    delta: float = 1e-5
    accountant: AccountantName = "rdp"
    secure_mode: bool = False
    # user-level DP (common/dp/central.py): "user" = DP-FedAvg, the server clips each update
    # to central-clip and adds central noise; the clients add none (mechanism noisy, sigma 0)
    dp_level: DPLevel = "sample"
    central_noise_multiplier: float = 1.0
    central_clip: float = 1.0
    central_noise: CentralNoise = "fresh"  # "seeded": reproducible, the noise is not secret
    # sparsification
    final_rate: float = 0.7
    schedule: ScheduleName = "gradual"
    cooling_rounds: int = 1
    initial_keep: float = 1.0
    final_keep: float = 1.0
    rate_steps: str = ""  # schedule=steps: comma-separated rates, e.g. "0,0.5,0.7,0.9"
    mask_scope: MaskScope = "round"
    # which coordinates train (common/methods/): a built-in name, or a user's Method subclass
    # as "package.module:Class" (accepted at run time: a run config's values are strings; the
    # type names the built-ins, which the parser's tests hold it to)
    method: FederatedMethodName = "rs"
    freeze_layers: int = 1  # lf: m_f, the first layers frozen ...
    freeze_after: int = 0  # lf: ... from this 0-based round on (round freeze-after + 1)
    public_fraction: float = 0.1  # dpssgd: share of the training set declared public
    public_epochs: int = 5  # dpssgd: the server's non-private pretraining on it
    selection: SelectionName = "magnitude"  # dpssgd: largest |w| per layer, or random
    selection_mode: SelectionMode = "freeze"  # dpssgd: once after pretraining, or each round
    index_budget_fraction: float = DEFAULT_INDEX_FRACTION  # gip: target-epsilon's share for indices
    group_size: int = 256  # gip, random-k: GIP's group length l
    # a plug-in method's own run-config keys (its ``Method.options``), as (key, value) pairs;
    # they travel as top-level keys (``to_run_config``), this field never does
    method_options: tuple[tuple[str, Any], ...] = ()
    # transport
    codec: CodecName = "values"
    # fp32, fp16, bf16, int8 (one scale per update) or the stochastically rounded int4, int2,
    # int1 (common/wire/payload/lowbit.py), whose rounding draws from OS entropy on a deployed node
    value_dtype: PayloadDType = "fp32"
    # int4/int2/int1: values per float32 step (32 / value-block bits per value); else unused
    value_block: int = DEFAULT_VALUE_BLOCK
    compression: Compression = "none"
    # data and model
    dataset: DatasetName = "digits"
    data_dir: str = ""
    partitioner: PartitionerName = "iid"
    dirichlet_alpha: float = 0.5
    model: ModelName | Literal[""] = ""  # "": the dataset's default (``model_name``)
    # what the server evaluates on: the test split, or a validation slice of the training
    # split (tuning: ``fedsparse sweep --tune``; the test split is then never read)
    eval_split: EvalSplit = "test"
    # digits' train/test split seed (-1: the run's seed); a tuned sweep fixes it so that no
    # tuning seed trains or validates on a final seed's test examples
    split_seed: int = -1
    seed: int = 0
    out_dir: str = ""
    # the server against its clients (server/strategy.py, common/aggregation/robust.py)
    weighting: Weighting = "uniform"  # "examples": trust num-examples (trusted/simulated)
    aggregator: AggregatorName = "mean"
    trim_fraction: float = 0.2  # aggregator=trimmed-mean: dropped at each end, per coordinate
    max_norm_ratio: float = 3.0  # x the round's median update norm, from 3 updates on; 0: off
    max_update_norm: float = 0.0  # absolute L2 bound; 0: off
    # "auto": also the bound an honest client's DP parameters imply (dp-level=sample with
    # mechanism dpsgd or clipped; common/aggregation/robust.py: HonestClientBound); "off": not
    dp_norm_bound: DPNormBound = "auto"
    # the most examples an honest client holds, for that bound (0: the size of the training
    # split the clients' partitions come from, which the server loads; set it where the
    # server cannot load it, or where nodes may declare larger local copies of the dataset)
    max_client_examples: int = 0
    norm_action: NormAction = "reject"  # or "clip": scale down to the bound
    max_failed_rounds: int = 3  # this many rounds in a row with no accepted update end the run
    # research: keep every valid reply's payload in <out-dir>/updates/ (what the server sees)
    save_updates: bool = False
    # per-round metrics also to experiment trackers in out-dir: tensorboard, mlflow or both,
    # comma-separated (server/tracking.py; needs the tracking extra); "": none
    log: str = ""
    # continue the run in out-dir from its checkpoint.pt (server/checkpoint.py)
    resume: bool = False

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
        for field, names in _NAMED_FIELDS.items():
            value = getattr(self, field)
            if field == "dataset" and plugins.is_reference(value):
                continue  # a user's loader (common/plugins.py): imported where it is loaded
            if value not in names:
                more = " or package.module:loader" if field == "dataset" else ""
                fail(field, f"one of {', '.join(names)}{more}")
        check_method_name(self.method)
        for target in self.trackers:
            if target not in TRACKERS:
                fail("log", f"some of {', '.join(TRACKERS)}, comma-separated ('' for none)")
        user_model = plugins.is_reference(self.model)
        user_dataset = plugins.is_reference(self.dataset)
        if self.model not in ("", *MODEL_NAMES) and not user_model:
            fail(
                "model",
                f"one of {', '.join(MODEL_NAMES)} ('' for the dataset's default) or "
                "package.module:factory",
            )
        if user_dataset and self.model == "":
            fail("model", f"a model for dataset={self.dataset!r} (a user's dataset has no default)")
        if not (user_model or user_dataset):  # a user's shapes are checked where they load
            model_shape = MODEL_INPUT_SHAPES[self.model_name]
            data_shape = DATASET_INPUT_SHAPES[self.dataset]
            if model_shape != data_shape:
                fits = [m for m in MODEL_NAMES if MODEL_INPUT_SHAPES[m] == data_shape]
                fail(
                    "model",
                    f"a model for dataset={self.dataset!r} ({_shape(data_shape)} images; "
                    f"{self.model} takes {_shape(model_shape)}): one of {', '.join(fits)} or ''",
                )
        if not 0 <= self.seed < 2**63:
            fail("seed", "0 <= seed < 2**63")
        if not 1 <= self.value_block < 2**32:
            fail("value_block", "1 <= value-block < 2**32")
        if not -1 <= self.split_seed < 2**63:
            fail("split_seed", "-1 (the run's seed) or 0 <= split-seed < 2**63")
        if self.dirichlet_alpha <= 0:
            fail("dirichlet_alpha", "> 0")
        self._check_robustness(fail)
        self._check_dp_level(fail)
        method = self.method_class()
        for key, _ in self.method_options:
            if key not in method.options:
                raise ValueError(
                    unknown_key(f"method={self.method!r}: run config key", key, method.options)
                )
        method.check_run(self)
        try:
            self.method_config()
            self.privacy()
            self.sparsity().rate_schedule(self.num_rounds)
        except ValueError as err:
            message = re.sub(r"(?<![\w-])steps=", "rate-steps=", str(err).replace("_", "-"))
            raise ValueError(message) from err

    def _check_robustness(self, fail: Callable[[str, str], None]) -> None:
        if not 0.0 <= self.trim_fraction < 0.5:
            fail("trim_fraction", "0 <= f < 0.5")
        if self.max_failed_rounds < 0:
            fail("max_failed_rounds", ">= 0 (0: never end the run)")
        if self.max_client_examples < 0:
            fail("max_client_examples", ">= 0 (0: the training split's size)")
        targeted = self.mechanism == "dpsgd" and self.target_epsilon > 0
        if self.dp_norm_bound_applies and targeted and self.target_epsilon <= _MIN_TARGET:
            fail(
                "target_epsilon",
                f"> {_MIN_TARGET:g} with dp-norm-bound='auto' (its worst-case sigma), or "
                "dp-norm-bound='off'",
            )
        if self.aggregator != "mean" and self.weighting != "uniform":
            fail(
                "weighting",
                f"'uniform' with aggregator={self.aggregator!r} (robust aggregators weigh "
                "every update equally)",
            )
        try:
            self.norm_bound()
        except ValueError as err:
            raise ValueError(str(err).replace("_", "-")) from err

    def _check_dp_level(self, fail: Callable[[str, str], None]) -> None:
        if not (math.isfinite(self.central_clip) and self.central_clip > 0):
            fail("central_clip", "a finite value > 0")
        if not (
            math.isfinite(self.central_noise_multiplier) and self.central_noise_multiplier >= 0
        ):
            fail("central_noise_multiplier", "a finite value >= 0")
        if self.dp_level != "user":
            return
        if self.clients_per_round < 1:
            fail("clients_per_round", ">= 1 with dp-level=user (the expected users per round)")
        if self.method_class().selects_per_step:
            fail("dp_level", "'sample' with method gip or random-k (the clients choose supports)")
        if self.mask_scope != "round":
            fail("dp_level", "'sample' with mask-scope=client (the noise needs one public mask)")
        if self.aggregator != "mean" or self.weighting != "uniform":
            fail("dp_level", "'sample' unless aggregator=mean and weighting=uniform")
        if self.secure_mode and self.central_noise != "fresh":
            fail("central_noise", "'fresh' with secure-mode=true (hardened noise takes no seed)")

    def method_class(self) -> type[Method]:
        """The class of ``method`` (``common/methods/registry.py``; a plug-in's module is
        imported: a deployed node checks its policy first, ``NodePolicy.check_plugins``)."""
        return method_class(self.method)

    def make_method(self) -> Method:
        """A fresh instance of the run's method, with its parameters."""
        return self.method_config().method()

    def method_config(self) -> MethodConfig:
        """The method and its parameters (``common/methods/``)."""
        return MethodConfig(
            name=self.method,
            freeze_layers=self.freeze_layers,
            freeze_after=self.freeze_after,
            public_fraction=self.public_fraction,
            public_epochs=self.public_epochs,
            selection=self.selection,
            selection_mode=self.selection_mode,
            index_budget_fraction=self.index_budget_fraction,
            group_size=self.group_size,
            options=self.method_options,
        )

    @property
    def data_seed(self) -> int:
        """The seed of the dataset's train/test split: ``split-seed``, or the run's seed."""
        return self.seed if self.split_seed < 0 else self.split_seed

    def norm_bound(self) -> NormBound:
        """The per-round bound on update norms (``max-norm-ratio``, ``max-update-norm``).

        The DP-derived part (``dp-norm-bound``) depends on the round's ``keep``: the strategy
        passes it to ``NormBound.bound`` from ``honest_client_bound``."""
        return NormBound(max_norm_ratio=self.max_norm_ratio, max_update_norm=self.max_update_norm)

    @property
    def dp_norm_bound_applies(self) -> bool:
        """``dp-norm-bound=auto`` and the DP parameters bound an update: ``dp-level=sample``
        (under ``user`` the server clips every update itself, ``central-clip``) with a
        mechanism that clips per sample (``noisy`` does not: nothing bounds its gradients)."""
        return (
            self.dp_norm_bound == "auto" and self.dp_level == "sample" and self.mechanism != "noisy"
        )

    def worst_case_noise_multiplier(self) -> float:
        """The largest sigma an honest client trains with: ``noise-multiplier``, or under a
        target epsilon the largest any data size calibrates (``robust.worst_case_noise_multiplier``
        over ``num-rounds x local-epochs`` epochs; ``method=gip``: for GIP's ``eps1``).

        Raises:
            ValueError: the target is unreachable (sigma > 1e6).
        """
        privacy = self.privacy()
        if privacy.target_epsilon is None:
            return float(privacy.noise_multiplier or 0.0)
        target = privacy.target_epsilon
        target = self.make_method().local_target(target)
        return worst_case_noise_multiplier(
            target_epsilon=target,
            delta=privacy.delta,
            epochs=self.num_rounds * self.local_epochs,
            accountant=privacy.accountant,
        )

    def honest_client_bound(self, train_examples: int) -> HonestClientBound | None:
        """The DP-derived bound's public caps (None where it does not apply).

        Args:
            train_examples: the size of the training split the clients' partitions come
                from, the most examples an honest client holds unless ``max-client-examples``
                says otherwise (> 0).
        """
        if not self.dp_norm_bound_applies:
            return None
        return HonestClientBound(
            lr=self.lr,
            momentum=self.momentum,
            max_grad_norm=self.max_grad_norm,
            noise_multiplier=self.worst_case_noise_multiplier(),
            batch_size=self.batch_size,
            local_epochs=self.local_epochs,
            max_examples=self.max_client_examples or train_examples,
            value_dtype=self.value_dtype,
            adaptive_support=self.method_class().adaptive_support,  # supports from the data
        )

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> FederatedConfig:
        """Builds the config from Flower's run config (dashed keys); unknown keys are errors.

        A key the run's method declares (``Method.options``: a plug-in's own keys) goes to
        ``method_options``; resolving the method imports a plug-in's module (a deployed node
        checks its policy first: ``NodePolicy.check_plugins``).
        """
        fields = {f.name: f for f in run_config_fields()}
        kwargs: dict[str, Any] = {}
        options: dict[str, Any] = {}
        declared: Mapping[str, Any] | None = None
        for key, value in run_config.items():
            name = key.replace("-", "_")
            if name in fields:
                kwargs[name] = coerce(key, value, type(fields[name].default))
                continue
            if declared is None:
                method = str(run_config.get("method", fields["method"].default))
                check_method_name(method)
                declared = method_class(method).options
            if key not in declared:
                raise ValueError(unknown_key("run config key", key, {**fields, **declared}))
            options[key] = coerce(key, value, type(declared[key]))
        return cls(**kwargs, method_options=tuple(sorted(options.items())))

    @property
    def trackers(self) -> tuple[str, ...]:
        """``log``'s tracker names, in order."""
        return tuple(name.strip() for name in self.log.split(",") if name.strip())

    @property
    def model_name(self) -> ModelName:
        """The model to build: ``model``, or ``DEFAULT_MODELS[dataset]`` when it is empty."""
        if self.model == "":
            return DEFAULT_MODELS[self.dataset]
        return self.model

    def to_run_config(self) -> dict[str, Any]:
        """The dashed-key mapping (what ``[tool.flwr.app.config]`` holds), a plug-in method's
        own keys (``method_options``) at the top level like the others."""
        mapping = {
            k.replace("_", "-"): v for k, v in dataclasses.asdict(self).items() if k != _NOT_A_KEY
        }
        return {**mapping, **dict(self.method_options)}

    def privacy(self) -> PrivacyConfig:
        """Local DP settings; target-epsilon > 0 wins over noise-multiplier.

        ``dp-level=user``: the clients add no noise and do not clip per sample (Opacus's
        ``noisy`` ablation at sigma 0, i.e. plain SGD on the round's support); their own
        accountant reports inf and the run's privacy is the server's user-level epsilon."""
        if self.dp_level == "user":
            return PrivacyConfig(
                mechanism="noisy",
                noise_multiplier=0.0,
                delta=self.delta,
                max_grad_norm=self.max_grad_norm,
                accountant=self.accountant,
            )
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
            schedule=method_schedule(self.method, self.schedule),
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


# Fields whose value is a name, and the names they accept (from the modules that implement them).
_NAMED_FIELDS: Final[dict[str, tuple[str, ...]]] = {
    "engine": ENGINES,
    "device": DEVICES,
    "mechanism": MECHANISMS,
    "accountant": ACCOUNTANTS,
    "schedule": SCHEDULES,
    "selection": SELECTIONS,
    "selection_mode": SELECTION_MODES,
    "mask_scope": MASK_SCOPES,
    "codec": CODECS,
    "value_dtype": PAYLOAD_DTYPES,
    "compression": COMPRESSIONS,
    "dataset": DATASET_NAMES,
    "eval_split": EVAL_SPLITS,
    "dp_level": DP_LEVELS,
    "central_noise": CENTRAL_NOISE_SOURCES,
    "partitioner": PARTITIONER_NAMES,
    "weighting": WEIGHTINGS,
    "aggregator": AGGREGATORS,
    "norm_action": NORM_ACTIONS,
    "dp_norm_bound": DP_NORM_BOUNDS,
}

#: The smallest target epsilon a worst-case sigma serves (robust.worst_case_noise_multiplier
#: lowers the target by the calibration tolerance and PRV's error).
_MIN_TARGET: Final = 0.03


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))
