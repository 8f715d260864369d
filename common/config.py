"""The federated run's configuration: one frozen dataclass built from Flower's run config.

``[tool.flwr.app.config]`` in ``pyproject.toml`` declares every key with its default; ``flwr
run --run-config`` and ``fedsparse simulate --set key=value`` override them. Both apps parse
the same mapping with ``FederatedConfig.from_run_config`` so server and clients agree, and a
bad value is rejected with the key's name and the value (``final-rate=1.2: expected 0 <= r <
1``), names included (``dataset='imagenet': expected one of digits, ...``): a typo fails at
parse time, not half a minute later inside Flower. The names each key accepts are listed in
``common/config_keys.py``. A plug-in method's own keys travel in one declared key,
``method-options`` (``key=value;key=value``): Flower's ``flwr run`` keeps only the keys
``pyproject.toml`` declares. Pure Python: the mapping is a plain dict, no Flower import.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fedsparse.common.aggregation.norm_bounds import (
    DPNormBound,
    HonestClientBound,
    NormAction,
    NormBound,
)
from fedsparse.common.aggregation.sparse import AggregatorName, Weighting
from fedsparse.common.coerce import coerce, format_pairs, parse_pairs, unknown_key
from fedsparse.common.config_keys import (
    ADDED_KEYS,
    CODECS,
    METHOD_OPTIONS,
    RESUME_MAY_DIFFER,
    TRACKERS,
    CodecName,
    method_option_values,
    with_added_keys,
)
from fedsparse.common.config_values import check_values, dp_norm_bound_applies, trackers
from fedsparse.common.data.datasets import DatasetName, EvalSplit
from fedsparse.common.data.partition import PartitionerName
from fedsparse.common.dp.accounting import AccountantName
from fedsparse.common.dp.central import CentralNoise, DPLevel
from fedsparse.common.dp.engines import EngineName
from fedsparse.common.dp.mechanisms import is_private
from fedsparse.common.dp.optimizer import MechanismName
from fedsparse.common.dp.worst_case import worst_case_noise_multiplier
from fedsparse.common.methods import (
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
from fedsparse.common.methods.schedules import ScheduleName
from fedsparse.common.models.classifiers import DEFAULT_MODELS, ModelName
from fedsparse.common.training.configs import DeviceName, PrivacyConfig, SparsityConfig
from fedsparse.common.wire.payload import DEFAULT_VALUE_BLOCK, Compression, PayloadDType
from fedsparse.common.wire.protocol import MASK_SCOPES, MaskScope

#: The public entry point of the run config: the dataclass, and the key table's names
#: (``config_keys``).
__all__ = [
    "ADDED_KEYS",
    "CODECS",
    "METHOD_OPTIONS",
    "RESUME_MAY_DIFFER",
    "TRACKERS",
    "MASK_SCOPES",
    "with_added_keys",
    "CodecName",
    "FederatedConfig",
    "MaskScope",
    "run_config_fields",
]


def run_config_fields() -> list[dataclasses.Field[Any]]:
    """The ``FederatedConfig`` fields, which are the run-config keys
    (``[tool.flwr.app.config]``), in order."""
    return list(dataclasses.fields(FederatedConfig))


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
    # local performance: the DP engine ("auto": func on CUDA, else factored; or a user's
    # EngineSpec as package.module:attribute) and the device ("auto": CUDA if the client has
    # one). Checked for availability where training runs, not here: the server parses this
    # config too and needs no GPU.
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
    # dp-level=user: the user-level epsilon the server calibrates the central sigma for (at
    # delta over num-rounds rounds, checked each round at its users' rate q =
    # clients-per-round / N; central-noise-multiplier is then not used); 0: off. With
    # secure-aggregation=true, for the fewest survivors a round decodes (server/secagg_round.py)
    central_target_epsilon: float = 0.0
    central_clip: float = 1.0
    central_noise: CentralNoise = "fresh"  # "seeded": reproducible, the noise is not secret
    # dp-level=user without a trusted server: the server decodes only the round's sum, each
    # client adds its share of the central noise (server/secagg_round.py); c colluders tolerated
    secure_aggregation: bool = False
    secagg_colluders: int = 0
    # each node's neighbours in a sparse ring (SecAgg+: common/aggregation/graph.py); 0: the
    # complete graph, every node masks with every other
    secagg_neighbours: int = 0
    # the masked values' ring width (common/aggregation/small_ring.py: flattened, rounded
    # conditionally, wraps allowed); 0: the exact ring, as wide as its wrap bound needs
    secagg_ring_bits: int = 0
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
    # a plug-in method's own keys (its Method.options) as "key=value;key=value": flwr run
    # passes only the keys pyproject.toml declares, so this one carries them. With a plug-in
    # method, fedsparse's --set puts each key the app does not declare here (--set stride=3)
    method_options: str = ""
    # transport
    codec: CodecName = "values"
    # fp32, fp16, bf16, int8 (one scale per update) or the stochastically rounded int4, int2,
    # int1 (common/wire/payload/lowbit.py), whose rounding draws from OS entropy on a deployed node
    value_dtype: PayloadDType = "fp32"
    # int4/int2/int1: values per float32 step (32 / value-block bits per value); else unused
    value_block: int = DEFAULT_VALUE_BLOCK
    # the client carries each round's quantization error (what value-dtype's rounding lost on
    # the sent values) into its next round's values, in its node state (fp16, bf16, int8,
    # int4; not int2/int1, whose rounding does not contract: docs/explanation/bandwidth.md)
    error_feedback: bool = False
    compression: Compression = "none"
    # the broadcast's value dtype (value-dtype's names; fp32: exact values, as before): a lossy
    # one sends the round's model change, rounded (int4/int2/int1 with value-block), to nodes a
    # version behind; the server adopts the decoded change, so every copy stays bit-identical
    downlink_dtype: PayloadDType = "fp32"
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
    # the nominal-size each simulated node declares (client/node_data.py): the public bound on
    # its count that its sampling rate, steps and sigma come from; 0: each node's real count.
    # A deployed node declares its own (this key chooses nothing there)
    nominal_size: int = 0
    seed: int = 0
    out_dir: str = ""
    # the server against its clients (server/strategy.py, common/aggregation/robust.py)
    weighting: Weighting = "uniform"  # "examples": trust num-examples (trusted/simulated)
    aggregator: AggregatorName = "mean"
    trim_fraction: float = 0.2  # aggregator=trimmed-mean: dropped at each end, per coordinate
    max_norm_ratio: float = 3.0  # x the round's median update norm, from 3 updates on; 0: off
    max_update_norm: float = 0.0  # absolute L2 bound; 0: off
    # "auto": also the bound an honest client's DP parameters imply (dp-level=sample with
    # mechanism dpsgd or clipped; common/aggregation/norm_bounds.py: HonestClientBound); "off": not
    dp_norm_bound: DPNormBound = "auto"
    # the most examples an honest client holds, for that bound (0: the size of the training
    # split the clients' partitions come from, which the server loads; set it where the
    # server cannot load it, or where nodes may declare larger local copies of the dataset)
    max_client_examples: int = 0
    # the fewest examples an honest client holds, for that bound (0: not declared: it covers
    # clients from the size the round's log names; declare it for smaller partitions)
    min_client_examples: int = 0
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

        # ranges, names and combinations: the checks a command runs before heavy imports
        check_values({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        try:
            self.norm_bound()
        except ValueError as err:
            raise ValueError(str(err).replace("_", "-")) from err
        if self.dp_level == "user" and self.method_class().selects_per_step:
            fail("dp_level", "'sample' with method gip or random-k (the clients choose supports)")
        method = self.method_class()
        # one spelling per value (resume and a finished sweep run compare run configs)
        canonical = format_pairs(METHOD_OPTIONS, dict(self.plugin_options()))
        object.__setattr__(self, "method_options", canonical)
        method.check_run(self)
        try:
            self.method_config()
            self.privacy()
            self.sparsity().rate_schedule(self.num_rounds)
        except ValueError as err:
            message = re.sub(r"(?<![\w-])steps=", "rate-steps=", str(err).replace("_", "-"))
            raise ValueError(message) from err

    def method_class(self) -> type[Method]:
        """The class of ``method`` (``common/methods/registry.py``; a plug-in's module is
        imported: a deployed node checks its policy first, ``NodePolicy.check_plugins``)."""
        return method_class(self.method)

    def make_method(self) -> Method:
        """A fresh instance of the run's method, with its parameters."""
        return self.method_config().method()

    def method_config(self) -> MethodConfig:
        """The method and its parameters (``common/methods/``)."""
        return self._method_config

    @functools.cached_property
    def _method_config(self) -> MethodConfig:  # a frozen config's, once (a round asks often)
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
            options=self.plugin_options(),
        )

    def plugin_options(self) -> tuple[tuple[str, Any], ...]:
        """``method-options`` parsed (``config_keys.method_option_values``): the plug-in's own
        keys and their values, typed by their defaults (``Method.options``), sorted by key."""
        return method_option_values(
            self.method_options,
            method=self.method,
            declared=self.method_class().options if self.method_options.strip() else {},
            known=(f.name for f in run_config_fields()),
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
        """``dp-norm-bound=auto`` and the DP parameters bound an update
        (``common/config_values.py: dp_norm_bound_applies``)."""
        return dp_norm_bound_applies(
            {
                "dp_norm_bound": self.dp_norm_bound,
                "dp_level": self.dp_level,
                "mechanism": self.mechanism,
            }
        )

    def worst_case_noise_multiplier(self) -> float:
        """The largest sigma an honest client trains with: ``noise-multiplier``, or under a
        target epsilon the largest any data size calibrates
        (``common/dp/worst_case.py`` over ``num-rounds x local-epochs``
        epochs; ``method=gip``: for GIP's ``eps1``).

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

    def honest_client_bound(
        self, train_examples: int, *, dense_size: int = 0
    ) -> HonestClientBound | None:
        """The DP-derived bound's public caps (None where it does not apply).

        Args:
            train_examples: the size of the training split the clients' partitions come
                from, the most examples a client holds unless ``max-client-examples`` says
                otherwise (> 0); dense_size: the model's ``d`` (needed by error feedback).

        Raises:
            ValueError: ``min-client-examples`` above that, or error feedback without ``d``.
        """
        if not self.dp_norm_bound_applies:
            return None
        most = self.max_client_examples or train_examples
        if self.min_client_examples > most:
            raise ValueError(
                f"min-client-examples={self.min_client_examples}: expected <= {most}, the most "
                "examples a client holds (max-client-examples, else the training split's size)"
            )
        if self.error_feedback and dense_size < 1:
            raise ValueError(f"dense_size={dense_size}: error feedback's bound needs d >= 1")
        return HonestClientBound(
            lr=self.lr,
            momentum=self.momentum,
            max_grad_norm=self.max_grad_norm,
            noise_multiplier=self.worst_case_noise_multiplier(),
            batch_size=self.batch_size,
            local_epochs=self.local_epochs,
            max_examples=most,
            min_examples=self.min_client_examples,
            value_dtype=self.value_dtype,
            adaptive_support=self.method_class().adaptive_support,  # supports from the data
            value_block=self.value_block,
            feedback_keep=dense_size if self.error_feedback else 0,
            feedback_rounds=self.num_rounds if self.error_feedback else 0,
        )

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> FederatedConfig:
        """Builds the config from Flower's run config (dashed keys); unknown keys are errors.

        A key the run's method declares (``Method.options``: a plug-in's own keys) goes to
        ``method-options`` with those it already holds (a mapping built in Python may hold
        them at the top level; Flower's run config holds only declared keys); resolving the
        method imports a plug-in's module (a deployed node checks its policy first:
        ``NodePolicy.check_plugins``).
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
        if options:
            carried = parse_pairs(METHOD_OPTIONS, kwargs.get("method_options", ""))
            for key in options.keys() & carried.keys():
                raise ValueError(
                    f"{key}={options[key]!r}: expected it once (also in "
                    f"{METHOD_OPTIONS}={kwargs['method_options']!r})"
                )
            kwargs["method_options"] = format_pairs(METHOD_OPTIONS, {**carried, **options})
        return cls(**kwargs)

    @property
    def trackers(self) -> tuple[str, ...]:
        """``log``'s tracker names, in order."""
        return trackers(self.log)

    @property
    def model_name(self) -> ModelName:
        """The model to build: ``model``, or ``DEFAULT_MODELS[dataset]`` when it is empty."""
        if self.model == "":
            return DEFAULT_MODELS[self.dataset]
        return self.model

    def to_run_config(self) -> dict[str, Any]:
        """The dashed-key mapping (what ``[tool.flwr.app.config]`` holds), a plug-in method's
        own keys in ``method-options``."""
        return {k.replace("_", "-"): v for k, v in dataclasses.asdict(self).items()}

    def privacy(self) -> PrivacyConfig:
        """Local DP settings; target-epsilon > 0 wins over noise-multiplier.

        ``dp-level=user``: the clients add no noise and do not clip per sample (Opacus's
        ``noisy`` ablation at sigma 0, i.e. plain SGD on the round's support); their own
        accountant reports inf and the run's privacy is the server's user-level epsilon."""
        return self._privacy

    @functools.cached_property
    def _privacy(self) -> PrivacyConfig:
        if self.dp_level == "user":
            return PrivacyConfig(
                mechanism="noisy",
                noise_multiplier=0.0,
                delta=self.delta,
                max_grad_norm=self.max_grad_norm,
                accountant=self.accountant,
            )
        use_target = is_private(self.mechanism) and self.target_epsilon > 0
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
