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
``noise``                  "fresh"        ``fresh``: DP noise and Poisson sampling from OS
                                          entropy on every train call; ``seeded``: from the
                                          run seed (simulation only: anyone who knows the run
                                          config can rebuild the noise)
``ledger-dir``             "~/.local/     directory of the persistent privacy ledger
                           state/         (``common/ledger.py``); "" keeps no ledger (the
                           fedsparse"     budget then spans one run only)
``state-dir``              ""             simulation only (``noise="seeded"``): directory
                                          where the node keeps its run state after each
                                          round it trains, so that a resumed run
                                          (``resume``) continues it; "" keeps none
``release-train-loss``     false          reply with the exact mean training loss
``release-example-count``  false          reply with the exact example counts (else 1 and 0;
                                          the server weights updates uniformly by default)
=========================  =============  ====================================================

Pure Python: the sources are plain mappings; the ClientApp passes the node config and the
``FEDSPARSE_NODE_POLICY`` environment variable (how a simulation launcher, which cannot set
node config keys in Flower 1.39, configures its simulated nodes).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Final, Literal, get_args

from fedsparse.common.dp import MECHANISMS, MechanismName

__all__ = [
    "NOISE_SOURCES",
    "POLICY_ENV",
    "NodePolicy",
    "NoiseSource",
    "PrivacyRefusal",
    "TrainingRequest",
    "parse_assignments",
]

NoiseSource = Literal["fresh", "seeded"]
NOISE_SOURCES: Final[tuple[NoiseSource, ...]] = get_args(NoiseSource)
#: Environment variable with ``key=value`` policy entries (node config syntax).
POLICY_ENV: Final = "FEDSPARSE_NODE_POLICY"
#: Node config keys that belong to Flower or the partitioning, not to the policy.
_NOT_POLICY: Final = frozenset({"partition-id", "num-partitions", "policy-file"})


class PrivacyRefusal(RuntimeError):
    """A train request the node's policy does not allow; nothing was trained or released."""


@dataclass(frozen=True)
class TrainingRequest:
    """What one round of local training would spend, as the policy and the ledger see it."""

    run_id: int
    server_round: int
    mechanism: MechanismName
    noise_multiplier: float
    sample_rate: float
    steps: int
    local_epochs: int
    #: GIP: the pure-DP epsilon of this round's index selection (data-independent, known
    #: before training: ``common/gip.py``), composed with the accountant's by addition.
    index_epsilon: float = 0.0


@dataclass(frozen=True, kw_only=True)
class NodePolicy:
    """A data owner's limits (see the module table for keys and defaults)."""

    epsilon_budget: float = 10.0
    delta: float = 1e-5
    min_noise_multiplier: float = 0.5
    allowed_mechanisms: tuple[MechanismName, ...] = ("dpsgd",)
    max_local_epochs: int = 10
    noise: NoiseSource = "fresh"
    ledger_dir: str = "~/.local/state/fedsparse"
    state_dir: str = ""
    release_train_loss: bool = False
    release_example_count: bool = False

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
        if self.noise not in NOISE_SOURCES:
            fail("noise", self.noise, f"one of {', '.join(NOISE_SOURCES)}")
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
        for source in sources:
            entries = dict(source)
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
                    raise ValueError(
                        f"node policy: unknown key {key!r}; known keys: {', '.join(sorted(known))}"
                    )
                values[known[key].name] = _coerce(key, value, type(known[key].default))
        return cls(**values)

    def check(self, request: TrainingRequest) -> None:
        """Refuses a request outside the static limits (the budget is the ledger's check).

        Raises:
            PrivacyRefusal: naming the field, the requested value and the limit.
        """
        if request.mechanism not in self.allowed_mechanisms:
            allowed = ",".join(self.allowed_mechanisms)
            raise PrivacyRefusal(
                f"mechanism={request.mechanism!r}: this node allows only {allowed}"
            )
        if request.mechanism == "dpsgd" and request.noise_multiplier < self.min_noise_multiplier:
            raise PrivacyRefusal(
                f"noise-multiplier={request.noise_multiplier:.4g}: this node requires >= "
                f"{self.min_noise_multiplier:g}"
            )
        if request.local_epochs > self.max_local_epochs:
            raise PrivacyRefusal(
                f"local-epochs={request.local_epochs}: this node allows <= {self.max_local_epochs}"
            )


def _coerce(key: str, value: Any, kind: type) -> Any:
    if kind is tuple:
        items = value if isinstance(value, list | tuple) else str(value).split(",")
        return tuple(str(item).strip() for item in items if str(item).strip())
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "false"):
            return str(value).lower() == "true"
        raise ValueError(f"node policy: {key}={value!r}: expected true or false")
    try:
        if kind is int and not isinstance(value, bool):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind is float and not isinstance(value, bool):
            return float(value)
        if kind is str:
            return str(value)
    except (TypeError, ValueError):
        pass
    raise ValueError(f"node policy: {key}={value!r}: expected {kind.__name__}")


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
