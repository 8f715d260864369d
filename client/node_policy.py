"""The node's own privacy policy: what a data owner allows, whatever the server asks.

In a deployment the server writes the run config and every message, so nothing it sends may
decide how private a client is. The SuperNode's owner sets a ``NodePolicy`` (node config
keys, optionally a TOML ``policy-file``), and the client checks every train request against
it *before* it touches its data; a request that breaks it is refused with one line naming the
field, and nothing is trained or released.

=========================  =============  ====================================================
key                        default        meaning
=========================  =============  ====================================================
``epsilon-budget``         10.0           total sample-level ε at ``delta`` this node's data
                                          may spend, over all runs (the ledger's sum)
``delta``                  1e-5           the δ at which the budget is held
``min-noise-multiplier``   0.5            smallest σ accepted
``allowed-mechanisms``     "dpsgd"        comma-separated; ``clipped``/``noisy`` are the RS
                                          paper's non-private ablations
``max-local-epochs``       10             local epochs per round
``min-batch-size``         16             smallest ``batch-size`` accepted (ε, σ and the
                                          steps come from the node's public ``nominal-size``,
                                          never its real count: ``client/node_data.py``)
``noise``                  "fresh"        ``fresh``: DP noise and Poisson sampling from OS
                                          entropy on every train call; ``seeded``: from the
                                          run seed (simulation only: anyone who knows the run
                                          config can rebuild the noise)
``ledger-dir``             "~/.local/     directory of the persistent privacy ledger
                           state/         (``client/ledger.py``); "" keeps no ledger (the
                           fedsparse"     budget then spans one run only)
``state-dir``              ""             simulation only (``noise="seeded"``): directory
                                          where the node keeps its run state after each
                                          round it trains, so that a resumed run
                                          (``resume``) continues it; "" keeps none
``release-train-loss``     false          reply with the exact mean training loss
``release-example-count``  false          reply with the exact example counts (else 1 and 0;
                                          the server weights updates uniformly by default):
                                          releases the real count ``nominal-size`` hides
``evaluate``               false          answer ``evaluate`` messages, on the public test
                                          split of the node's declared dataset (never on its
                                          training data); false refuses them
``allowed-fab-hashes``     ""             comma-separated SHA-256 digests of the FABs (app
                                          bundles) this node takes part in runs of; "" takes
                                          any whose ClientApp is fedsparse's. Either way the
                                          node runs its OWN installed ClientApp, never code
                                          from the FAB (``client/node.py``)
``plugin-methods``         ""             comma-separated ``package.module:Class`` methods
                                          (``common/methods/``) this node may import when a
                                          run config names one as its ``method``; "" imports
                                          none. A simulated node (``noise="seeded"``) imports
                                          any: the run is the experimenter's own. Built-in
                                          names need no entry. Listing one trusts it with the
                                          node's privacy accounting (``Method.split_privacy``)
                                          and with the server's values of its own keys
``plugin-models``          ""             the same for ``model``: ``package.module:factory``
                                          model factories (``common/models/classifiers.py``)
``plugin-engines``         ""             the same for ``engine``: ``package.module:spec`` DP
                                          engines (``common/dp/engines/``). Listing one
                                          trusts it with the clipped, noised sum the node's
                                          ε is charged for
``secure-aggregation``     "allow"        ``allow``: take part in runs with or without
                                          secure aggregation; ``require``: refuse every
                                          round whose update the server would see alone;
                                          ``refuse``: never (``client/secagg_node.py``). With
                                          it, ``min-noise-multiplier`` bounds half the node's
                                          own noise share (the worst case, ``σ_wc / 2``: what
                                          its data sees), whatever the server; a deployed
                                          node needs its ``ledger-dir`` for it
``secagg-colluders``       0              the most clients this node assumes collude with
                                          the server: it refuses a threshold ``t`` unless
                                          ``2t - n`` exceeds it
``secagg-identity``        ""             path of this node's Ed25519 private key (PEM): it
                                          signs its keys each round
                                          (``client/secagg_identity.py``); "" signs nothing;
                                          ``{partition-id}`` in it is the node config's
                                          (one policy, a key file a node)
``secagg-roster``          ""             path of the identities this node's owner trusts
                                          not to collude with the server, one hex public
                                          key a line
``secagg-min-trusted``     0              the fewest trusted peers (on the roster, signed
                                          as enforcing) in the ring; > 0: this node enforces
                                          (a ring with fewer, peers that did not sign its
                                          ring, or a survivor set signed by fewer than ``t``
                                          trusted identities is refused); needs a
                                          ``ledger-dir``
=========================  =============  ====================================================

The node's data is declared next to its policy, in the same node config
(``client/node_data.py``: ``dataset``, ``data-dir``, ``partition-id``, ...).

Pure Python: the sources are plain mappings; the ClientApp passes the node config and the
``FEDSPARSE_NODE_POLICY`` environment variable (how a simulation launcher, which cannot set
node config keys in Flower 1.39, configures its simulated nodes).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Final, Literal, get_args

from fedsparse.client.node_data import DATA_KEYS
from fedsparse.common import plugins
from fedsparse.common.coerce import coerce, unknown_key
from fedsparse.common.dp.mechanisms import is_private
from fedsparse.common.names import MECHANISMS, METHOD_NAMES, MechanismName

__all__ = [
    "NOISE_SOURCES",
    "POLICY_ENV",
    "SECAGG",
    "SECURE_AGGREGATION",
    "SIMULATION_NODE_POLICY",
    "NodePolicy",
    "NoiseSource",
    "SecureAggregation",
    "PrivacyRefusal",
    "TrainingRequest",
    "check_node_config",
    "node_config_text",
    "parse_assignments",
]

NoiseSource = Literal["fresh", "seeded"]
NOISE_SOURCES: Final[tuple[NoiseSource, ...]] = get_args(NoiseSource)
#: ``TrainingRequest.mechanism`` of a round released through secure aggregation.
SECAGG: Final = "secagg"
SecureAggregation = Literal["allow", "require", "refuse"]
SECURE_AGGREGATION: Final[tuple[SecureAggregation, ...]] = get_args(SecureAggregation)
#: Environment variable with ``key=value`` policy entries (node config syntax).
POLICY_ENV: Final = "FEDSPARSE_NODE_POLICY"
#: The node policy of simulated nodes, played by the experimenter: seeded noise for
#: reproducible runs (so NOT private against the server: the run summary says so), no
#: persistent ledger, every mechanism and σ allowed, losses and counts released. What every
#: simulation backend sets, and what a ClientApp in Flower's own simulation engine
#: (``flwr run`` on a local simulation) takes when nothing else is set (``client/guard.py``).
SIMULATION_NODE_POLICY: Final[Mapping[str, Any]] = {
    "noise": "seeded",
    "ledger-dir": "",
    "epsilon-budget": math.inf,
    "min-noise-multiplier": 0.0,
    "allowed-mechanisms": "dpsgd,clipped,noisy",
    "max-local-epochs": 1000,
    "min-batch-size": 1,
    "release-train-loss": True,
    "release-example-count": True,
}
#: Node config keys that belong to Flower or the node's data, not to the policy.
_NOT_POLICY: Final = frozenset({"policy-file", *DATA_KEYS})


#: In ``secagg-identity``: this node's ``partition-id`` (one policy for many nodes, as a
#: simulation's ``FEDSPARSE_NODE_POLICY`` or one owner's SuperNodes: a key file each).
PARTITION_SLOT: Final = "{partition-id}"


def _node_identity(template: str, partition: object) -> str:
    """``secagg-identity`` with ``PARTITION_SLOT`` replaced by the node's ``partition-id``."""
    try:
        number = coerce("partition-id", partition, int)
    except ValueError:
        number = -1
    if partition is None or number < 0:
        raise ValueError(
            f"node policy: secagg-identity={template!r}: names {PARTITION_SLOT}, and this "
            f"node's config has partition-id={partition!r}: expected an int >= 0"
        )
    return template.replace(PARTITION_SLOT, str(number))


class PrivacyRefusal(RuntimeError):
    """A request the node's policy does not allow; nothing was trained or released.

    Its message is what the server is told: which limit, never a number that depends on the
    node's data or history. ``detail`` is for the node's own log.
    """

    def __init__(self, message: str, *, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


@dataclass(frozen=True)
class TrainingRequest:
    """What one round of local training would spend, as the policy and the ledger see it."""

    run_id: int
    server_round: int
    #: ``secagg``: a secure-aggregation release, ``noise_multiplier`` the node's worst case
    mechanism: MechanismName | Literal["secagg"]
    noise_multiplier: float
    sample_rate: float
    steps: int
    local_epochs: int
    #: GIP: the pure-DP epsilon of this round's index selection (data-independent, known
    #: before training: ``common/methods/index_selection.py``), composed with the
    #: accountant's by addition.
    index_epsilon: float = 0.0
    #: Whether ``noise_multiplier`` was calibrated on the node (from the run's target
    #: epsilon and the node's data size) rather than sent by the server.
    calibrated: bool = False


@dataclass(frozen=True, kw_only=True)
class NodePolicy:
    """A data owner's limits (see the module table for keys and defaults)."""

    epsilon_budget: float = 10.0
    delta: float = 1e-5
    min_noise_multiplier: float = 0.5
    allowed_mechanisms: tuple[MechanismName, ...] = ("dpsgd",)
    max_local_epochs: int = 10
    min_batch_size: int = 16
    noise: NoiseSource = "fresh"
    ledger_dir: str = "~/.local/state/fedsparse"
    state_dir: str = ""
    release_train_loss: bool = False
    release_example_count: bool = False
    evaluate: bool = False
    allowed_fab_hashes: tuple[str, ...] = ()
    plugin_methods: tuple[str, ...] = ()
    plugin_models: tuple[str, ...] = ()
    plugin_engines: tuple[str, ...] = ()
    secure_aggregation: SecureAggregation = "allow"
    secagg_colluders: int = 0
    secagg_identity: str = ""
    secagg_roster: str = ""
    secagg_min_trusted: int = 0

    def __post_init__(self) -> None:
        def fail(key: str, value: Any, expected: str) -> None:
            raise ValueError(f"node policy: {key}={value!r}: expected {expected}")

        if math.isnan(self.epsilon_budget) or self.epsilon_budget < 0:
            fail("epsilon-budget", self.epsilon_budget, "a value >= 0 (inf: no limit)")
        if not 0 < self.delta < 1:
            fail("delta", self.delta, "0 < delta < 1")
        if not (math.isfinite(self.min_noise_multiplier) and self.min_noise_multiplier >= 0):
            fail("min-noise-multiplier", self.min_noise_multiplier, "a finite value >= 0")
        for mechanism in self.allowed_mechanisms:
            if mechanism not in MECHANISMS:
                fail("allowed-mechanisms", mechanism, f"names from {', '.join(MECHANISMS)}")
        if self.max_local_epochs < 1:
            fail("max-local-epochs", self.max_local_epochs, ">= 1")
        if self.min_batch_size < 1:
            fail("min-batch-size", self.min_batch_size, ">= 1")
        if self.noise not in NOISE_SOURCES:
            fail("noise", self.noise, f"one of {', '.join(NOISE_SOURCES)}")
        for digest in self.allowed_fab_hashes:
            if not (len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
                fail("allowed-fab-hashes", digest, "SHA-256 hex digests (64 lowercase hex)")
        for key, names in (
            ("plugin-methods", self.plugin_methods),
            ("plugin-models", self.plugin_models),
            ("plugin-engines", self.plugin_engines),
        ):
            for name in names:
                if not _is_plugin_method(name):
                    fail(key, name, "package.module:attribute names")
        if self.secure_aggregation not in SECURE_AGGREGATION:
            fail("secure-aggregation", self.secure_aggregation, "allow, require or refuse")
        if self.secagg_colluders < 0:
            fail("secagg-colluders", self.secagg_colluders, ">= 0")
        if not 0 <= self.secagg_min_trusted < 2**32:
            fail("secagg-min-trusted", self.secagg_min_trusted, ">= 0")
        if self.secagg_min_trusted and not self.secagg_roster:
            fail("secagg-roster", self.secagg_roster, "a roster file with secagg-min-trusted > 0")
        if self.secagg_min_trusted and not self.ledger_dir:  # it signs that it enforces: its
            # peers then count on it sharing in one ring, signing one set, unmasking once a
            # round across copies of its state, which only its ledger holds
            fail("ledger-dir", self.ledger_dir, "a directory with secagg-min-trusted > 0")
        if self.state_dir and self.noise != "seeded":
            # Restoring run state follows the server's resume point: only an experimenter's
            # own simulated nodes may take it; a deployed node's ledger is its history.
            fail("state-dir", self.state_dir, "'' unless noise='seeded' (simulation only)")

    @classmethod
    def from_sources(cls, *sources: Mapping[str, Any]) -> NodePolicy:
        """The policy from ``sources``, later ones overriding earlier ones.

        Each source is a node-config-like mapping; a ``policy-file`` entry loads a TOML file
        of the same keys in that source's place. Keys that are not policy keys
        (``partition-id``, ...) are ignored; an unknown ``key`` that looks like a policy key
        is an error, so a typo cannot silently weaken a limit.
        """
        known = {f.name.replace("_", "-"): f for f in fields(cls)}
        values: dict[str, Any] = {}
        partition: object = None  # the node config's partition-id (the identity's template)
        for source in sources:
            entries = dict(source)
            if "partition-id" in entries:  # the node config's (not a policy file's)
                partition = entries["partition-id"]
            if "policy-file" in entries:
                path = Path(str(entries["policy-file"])).expanduser()
                try:
                    entries = {**tomllib.loads(path.read_text()), **entries}
                except (OSError, tomllib.TOMLDecodeError) as err:
                    raise ValueError(f"node policy: policy-file={str(path)!r}: {err}") from None
            for key, value in entries.items():
                if key in _NOT_POLICY:
                    continue
                if key not in known:
                    raise ValueError(unknown_key("node policy: key", key, known))
                values[known[key].name] = coerce(
                    key, value, type(known[key].default), where="node policy"
                )
        if PARTITION_SLOT in values.get("secagg_identity", ""):
            values["secagg_identity"] = _node_identity(values["secagg_identity"], partition)
        return cls(**values)

    def check_plugins(self, run_config: Mapping[str, Any]) -> None:
        """Refuses a run config whose ``method``, ``model`` or ``engine`` is a plug-in
        (``package.module:attribute``) this node's owner did not list for that role
        (``plugin-methods``, ``plugin-models``, ``plugin-engines``), unless the node is
        simulated. Imports nothing: importing a module runs its code, and the run config is
        the server's. A name listed for one role is refused in the other (a model factory is
        not a method). The dataset
        is the node's own declaration, never the server's choice (``client/guard.py:
        declaration``).

        Raises:
            PrivacyRefusal: naming the key, its value and the policy key.
        """
        if self.noise == "seeded":
            return
        for key, listed in (
            ("method", self.plugin_methods),
            ("model", self.plugin_models),
            ("engine", self.plugin_engines),
        ):
            value = str(run_config.get(key, ""))
            if _is_plugin_method(value) and value not in listed:
                raise PrivacyRefusal(
                    f"{key}={value!r}: this node imports only the plug-in {key}s its owner "
                    f"lists (node policy plugin-{key}s)"
                )

    def precheck(
        self,
        *,
        mechanism: str,
        local_epochs: int,
        noise_multiplier: float | None,
        batch_size: int | None = None,
    ) -> None:
        """Refuses what the server's request alone breaks, before any data or calibration.

        Args:
            noise_multiplier: the run's fixed σ; None when the node calibrates it (then
                ``check`` tests it once it is known).
            batch_size: the instruction's batch size (None: not checked).

        Raises:
            PrivacyRefusal: naming the field, the value the server sent and the limit.
        """
        if mechanism == SECAGG:
            if self.secure_aggregation == "refuse":
                raise PrivacyRefusal(
                    "secure-aggregation=true: this node's policy refuses secure aggregation"
                )
        elif self.secure_aggregation == "require":
            raise PrivacyRefusal(
                "secure-aggregation=false: this node takes part only in secure aggregation "
                "(node policy secure-aggregation=require)"
            )
        elif mechanism not in self.allowed_mechanisms:
            allowed = ",".join(self.allowed_mechanisms)
            raise PrivacyRefusal(f"mechanism={mechanism!r}: this node allows only {allowed}")
        if local_epochs > self.max_local_epochs:
            raise PrivacyRefusal(
                f"local-epochs={local_epochs}: this node allows <= {self.max_local_epochs}"
            )
        if batch_size is not None and batch_size < self.min_batch_size:
            raise PrivacyRefusal(
                f"batch-size={batch_size}: this node requires >= {self.min_batch_size}"
            )
        if mechanism == SECAGG and noise_multiplier is not None:
            # its own share, sigma_wc; its data sees sigma_wc / 2 (client/secagg_node.py)
            if noise_multiplier / 2 < self.min_noise_multiplier:
                raise PrivacyRefusal(
                    f"secure aggregation: this node's own noise share, multiplier "
                    f"{noise_multiplier:.4g}, is {noise_multiplier / 2:.4g} for its data; "
                    f"this node requires >= {self.min_noise_multiplier:g}"
                )
        elif (
            is_private(mechanism)
            and noise_multiplier is not None
            and noise_multiplier < self.min_noise_multiplier
        ):
            raise PrivacyRefusal(
                f"noise-multiplier={noise_multiplier:.4g}: this node requires >= "
                f"{self.min_noise_multiplier:g}"
            )

    def check(self, request: TrainingRequest) -> None:
        """Refuses a request outside the static limits (the budget is the ledger's check).

        A σ the node calibrated is not named in the refusal: it depends on the node's data
        size.

        Raises:
            PrivacyRefusal: naming the field and the limit.
        """
        self.precheck(
            mechanism=request.mechanism,
            local_epochs=request.local_epochs,
            noise_multiplier=None if request.calibrated else request.noise_multiplier,
        )
        if (
            request.calibrated
            and is_private(request.mechanism)
            and request.noise_multiplier < self.min_noise_multiplier
        ):
            raise PrivacyRefusal(
                "target-epsilon: the noise multiplier it calibrates to on this node is below "
                f"this node's min-noise-multiplier={self.min_noise_multiplier:g}",
                detail=f"calibrated noise-multiplier={request.noise_multiplier:.4g}",
            )


def parse_assignments(text: str) -> dict[str, Any]:
    """``key=value`` entries separated by spaces, values in TOML syntax or bare strings.

    The syntax of ``flower-supernode --node-config`` (``"a=1 b='x' c=true"``).
    """
    entries: dict[str, Any] = {}
    for item in text.split():
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{POLICY_ENV}: {item!r}: expected key=value")
        try:
            entries[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            entries[key] = raw
    return entries


def _is_plugin_method(name: str) -> bool:
    """Whether ``name`` is a ``package.module:Class`` method (not a built-in); imports nothing."""
    return name not in METHOD_NAMES and plugins.is_reference(name)


def check_node_config(node_config: str, environment: str = "") -> None:
    """Checks a node's policy and data declaration before it starts (``fedsparse node``), in
    milliseconds: ``node_config`` is ``--node-config``'s text, ``environment`` the value of
    ``$FEDSPARSE_NODE_POLICY``. A deployed node (fresh noise) that declares data must declare
    its ``nominal-size`` (``client/node_data.py``).

    Raises:
        ValueError: a bad key or value (named), or declared data without a ``nominal-size``.
    """
    from fedsparse.client.node_data import NodeData

    sources = (parse_assignments(environment), parse_assignments(node_config))
    policy = NodePolicy.from_sources(*sources)
    declared = NodeData.from_sources(*sources)
    if declared is not None and declared.nominal_size == 0 and policy.noise != "seeded":
        raise ValueError(
            "node data: nominal-size: required with dataset=... on a node with fresh noise "
            "(the most examples this node may ever hold: its sampling rate and every number "
            "it reports come from it, never from its real count)"
        )


def node_config_text(supernode_args: Sequence[str]) -> str:
    """``--node-config``'s text among ``flower-supernode``'s arguments ("" when absent)."""
    for i, arg in enumerate(supernode_args):
        if arg == "--node-config" and i + 1 < len(supernode_args):
            return supernode_args[i + 1]
        if arg.startswith("--node-config="):
            return arg.split("=", 1)[1]
    return ""
