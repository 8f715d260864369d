"""The run-record schema, written once: ``rounds.jsonl`` lines and ``summary.json``.

The ServerApp writes one ``RoundLog`` per round and one ``RunSummary`` per run; the sweep, the
report, the live table and the wire report read them back with ``from_json``. Field metadata
says which fields a consumer uses, so no consumer spells the schema again:

* ``RunSummary`` fields tagged ``metric`` are the per-run numbers a sweep copies into
  ``results.csv`` and averages over seeds;
* ``RoundLog`` fields tagged ``per_round`` are the per-round curves a sweep keeps
  (``rounds.csv``) and plots.

Fields added after the first release come last and have defaults, so records written before
them still parse (``from_json`` fills a missing field that has a default).

Every ``summary.json``, federated (``RunSummary``) or centralized (``fedsparse train``,
``lab/experiments/train.py``), carries the same header and the same names for the figures
both have (``SHARED_SUMMARY_KEYS``, with their JSON types): ``kind`` ("federated" |
"train"), ``schema`` (``SCHEMA``; 1: a summary older than the header), ``command`` (the
command line that started the run; ``null`` from the Python API), ``config_hash``
(``config_hash``: the first 16 hex digits of the SHA-256 of the config's canonical JSON),
``versions``, ``engine`` (the DP engine used, "auto" resolved), ``noise_multiplier_min`` and
``noise_multiplier_max`` (sigma as the clients' accountants calibrated it, over the run;
``null`` for a non-private mechanism), and ``final_test_accuracy``, ``final_test_loss``,
``epsilon_max``, ``delta``, ``parameters``, ``wall_seconds``, ``total_density``, ``config``.
A figure that does not apply to a run is ``null``, not 0.

Pure Python (no Flower): a record is plain data.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, Self

from fedsparse.common.atomic import SHARED, write_atomically
from fedsparse.common.wire.run_header import (
    SCHEMA,
    SHARED_SUMMARY_KEYS,
    SOFTWARE,
    UNHASHED_KEYS,
    RunKind,
    command_line,
    config_hash,
    shared_key_problems,
    software_versions,
    summary_header,
)

__all__ = [
    "BITS_PER_PARAM_REFERENCES",
    "FAILURE_FILE",
    "LINKS",
    "NOISE_ORIGINS",
    "NoiseOrigin",
    "RUNNERS",
    "Runner",
    "RoundLog",
    "RunSummary",
    "RunKind",
    "SCHEMA",
    "SEEDED_RUN",
    "SHARED_SUMMARY_KEYS",
    "SOFTWARE",
    "UNHASHED_KEYS",
    "command_line",
    "config_hash",
    "epsilon_stats",
    "noise_range",
    "one_line",
    "per_round_fields",
    "read_rounds",
    "record_command",
    "round_noise",
    "run_noise",
    "shared_key_problems",
    "software_versions",
    "summary_header",
    "summary_metrics",
    "untrained",
    "uplink_bits_per_param",
]

Link = Literal["uplink", "downlink"]
#: The two directions, as they appear in field names (``uplink_payload_bytes``, ...).
LINKS: tuple[Link, ...] = ("uplink", "downlink")

NoiseOrigin = Literal["seeded", "fresh", "mixed", "none", "unknown"]
"""Where a round's accepted updates got their DP noise (the replies' ``seeded-noise``): all
from seeded streams (anyone knowing the run config can rebuild it: simulation), all from OS
entropy, both, no accepted update, or not recorded (a line older than the field)."""

NOISE_ORIGINS: tuple[NoiseOrigin, ...] = ("seeded", "fresh", "mixed", "none", "unknown")

#: What trained a client's round (``RoundLog.runners``): ``vectorised``, the population
#: step across clients (``client/population.py``); ``client-round``, one client's
#: ``client_round`` inside a population batch (a method or setting the step does not take:
#: ``population_error``); ``client-app``, a ClientApp answering the message alone (fedsparse's
#: runs ``client_round``; a node's override runs its own code).
Runner = Literal["vectorised", "client-round", "client-app"]
RUNNERS: tuple[Runner, ...] = ("vectorised", "client-round", "client-app")

#: ``RunSummary.noise`` of a run in which any accepted update had seeded noise.
SEEDED_RUN = "seeded: not private against the server"

#: Published uplink costs, in bits per model parameter per client and round, that reports place
#: runs against: dense fp32; the distributed discrete Gaussian with SecAgg
#: (Kairouz, Liu & Steinke, ICML 2021, about 16 bits at no accuracy loss); SecAgg + central DP
#: with compression (Chen, Choquette-Choo, Kairouz & Suresh, ICML 2022, about 1.2 bits at no
#: accuracy loss).
BITS_PER_PARAM_REFERENCES: dict[str, float] = {
    "dense fp32": 32.0,
    "distributed discrete Gaussian (Kairouz et al. 2021)": 16.0,
    "SecAgg + central DP (Chen et al. 2022)": 1.2,
}

_PER_ROUND = {"per_round": True}
_METRIC = {"metric": True}


def uplink_bits_per_param(payload_bytes: float, dense_bytes: float) -> float:
    """Uplink bits per model parameter per answering client: ``32 * payload / dense``.

    ``dense`` is ``4 d`` bytes per answering client, so this is the payload's bits over the
    parameters those clients could have sent (32 for dense fp32); NaN when no client answered.
    """
    return 32.0 * payload_bytes / dense_bytes if dense_bytes else math.nan


def _from_mapping(cls: type[Any], data: Mapping[str, Any], what: str) -> Any:
    """``cls(**data)`` restricted to ``cls``'s fields; a missing field is a named error."""
    fields = dataclasses.fields(cls)
    required = (dataclasses.MISSING, dataclasses.MISSING)
    missing = [
        f.name for f in fields if f.name not in data and (f.default, f.default_factory) == required
    ]
    if missing:
        raise ValueError(f"{what}: missing field(s) {', '.join(missing)}")
    return cls(**{f.name: data[f.name] for f in fields if f.name in data})


@dataclass(frozen=True, kw_only=True)
class RoundLog:
    """One line of ``rounds.jsonl``: what happened in one round, bytes and privacy included."""

    round: int = field(metadata=_PER_ROUND)
    num_clients: int  # clients selected
    num_replies: int  # replies received (errors included) before the round timeout
    num_rejected: int  # client errors and replies that failed validation
    rate: float = field(metadata=_PER_ROUND)
    keep: int
    keep_fraction: float = field(metadata=_PER_ROUND)
    test_accuracy: float = field(metadata=_PER_ROUND)
    test_loss: float = field(metadata=_PER_ROUND)
    epsilon_max: float = field(metadata=_PER_ROUND)
    epsilon_median: float
    train_loss: float = field(metadata=_PER_ROUND)
    uplink_payload_bytes: int = field(metadata=_PER_ROUND)
    uplink_message_bytes: int = field(metadata=_PER_ROUND)
    downlink_payload_bytes: int = field(metadata=_PER_ROUND)
    downlink_message_bytes: int = field(metadata=_PER_ROUND)
    dense_uplink_bytes: int = field(metadata=_PER_ROUND)  # 4 d per answering client
    dense_downlink_bytes: int = field(metadata=_PER_ROUND)  # 4 d per selected client
    wall_seconds: float = field(metadata=_PER_ROUND)
    started_at: float  # unix time the round began (to match wire captures by time)
    ended_at: float  # unix time the round's line was written
    rejected: list[str]  # one reason per rejected reply
    num_missing: int = 0  # selected clients with no reply by the round timeout
    num_accepted: int = -1  # updates aggregated (-1 when built: num_replies - num_rejected)
    failed: bool = False  # no update accepted, or the aggregate was refused: model unchanged
    failure: str = ""  # why the round failed ("" if it did not)
    noise: NoiseOrigin = "unknown"  # the accepted updates' noise origin
    clipped: list[str] = field(default_factory=list)  # one reason per update scaled down
    #: uplink payload bits per parameter per answering client (derived: ``32 * up / dense``)
    uplink_bits_per_param: float = field(default=math.nan, metadata=_PER_ROUND)
    #: dp-level=user: the run's user-level epsilon after this round (None, ``null``: a
    #: sample-level run, where no user-level figure applies; older records wrote 0)
    user_epsilon: float | None = None
    #: the smallest and largest sigma (noise multiplier) the accepted updates' accountants
    #: calibrated this round (None, ``null``: no accepted update, a non-private mechanism, or
    #: a line older than the fields)
    noise_multiplier_min: float | None = None
    noise_multiplier_max: float | None = None
    downlink_bits_per_param: float = field(default=math.nan, metadata=_PER_ROUND)  # per selected
    #: secure-aggregation=true: the run's central epsilon against the server, which knows who
    #: it sampled (rate 1 every round; ``user_epsilon`` is the released models' figure), and
    #: each stage's payload bytes, ``{stage: {"down": ..., "up": ...}}`` (None: in the clear)
    central_epsilon: float | None = None
    secagg_bytes: dict[str, dict[str, int]] | None = None
    #: dp-level=user: the noise multiplier of the round's central noise (the server's:
    #: ``central-noise-multiplier``, or the one calibrated for ``central-target-epsilon``;
    #: under secure aggregation the one the survivors' shares give). None, ``null``: a
    #: sample-level run, a secure round that released nothing, or a line older than the field
    central_noise_multiplier: float | None = None
    #: how many of the round's answered train messages each runner trained (``RUNNERS``),
    #: ``{runner: count}``, as the grid counted them; None, ``null``: a grid that does not say
    #: (a deployment's SuperLink, Flower's simulation engine) or a line older than the field
    runners: dict[str, int] | None = None

    def __post_init__(self) -> None:
        for link in LINKS:
            bits = uplink_bits_per_param(self.payload_bytes(link), self.dense_bytes(link))
            object.__setattr__(self, f"{link}_bits_per_param", bits)
        if self.num_accepted == -1:
            object.__setattr__(self, "num_accepted", self.num_replies - self.num_rejected)
        if self.noise not in NOISE_ORIGINS:
            raise ValueError(f"noise={self.noise!r}: expected one of {', '.join(NOISE_ORIGINS)}")
        unknown = sorted(set(self.runners or ()) - set(RUNNERS))
        if unknown:
            raise ValueError(f"runners={self.runners!r}: expected keys among {', '.join(RUNNERS)}")

    def to_json(self) -> str:
        """One ``rounds.jsonl`` line (no newline)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, data: str | Mapping[str, Any]) -> Self:
        """Parses one line (or its decoded mapping); extra keys are ignored."""
        mapping = json.loads(data) if isinstance(data, str) else data
        return _from_mapping(cls, mapping, "rounds.jsonl line")  # type: ignore[no-any-return]

    def payload_bytes(self, link: Link) -> int:
        """Payload bytes sent on ``link`` this round."""
        return int(getattr(self, f"{link}_payload_bytes"))

    def message_bytes(self, link: Link) -> int:
        """Serialized Flower-message bytes sent on ``link`` this round."""
        return int(getattr(self, f"{link}_message_bytes"))

    def dense_bytes(self, link: Link) -> int:
        """The dense fp32 baseline of ``link`` this round."""
        return int(getattr(self, f"dense_{link}_bytes"))


#: ``RoundLog`` byte fields summed into ``RunSummary.total_<field>``.
_TOTALS = (
    "uplink_payload_bytes",
    "uplink_message_bytes",
    "downlink_payload_bytes",
    "downlink_message_bytes",
    "dense_uplink_bytes",
    "dense_downlink_bytes",
)


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """``summary.json``: the run's final numbers, byte totals and the config it ran."""

    rounds: int
    parameters: int
    final_test_accuracy: float = field(metadata=_METRIC)
    final_test_loss: float
    epsilon_max: float = field(metadata=_METRIC)
    epsilon_median: float
    delta: float
    total_uplink_payload_bytes: int = field(metadata=_METRIC)
    total_uplink_message_bytes: int = field(metadata=_METRIC)
    total_downlink_payload_bytes: int = field(metadata=_METRIC)
    total_downlink_message_bytes: int = field(metadata=_METRIC)
    total_dense_uplink_bytes: int = field(metadata=_METRIC)
    total_dense_downlink_bytes: int = field(metadata=_METRIC)
    uplink_savings: float = field(metadata=_METRIC)  # dense uplink / uplink payload
    uplink_message_savings: float  # dense uplink / uplink Flower messages
    rejected_updates: int
    wall_seconds: float
    config: dict[str, Any]
    failed_rounds: int = 0  # rounds that left the model unchanged (``RoundLog.failed``)
    #: the accepted updates' noise: ``SEEDED_RUN`` if any was seeded, else "fresh" ("none": no
    #: update was accepted; "unknown": rounds older than the field)
    noise: str = "unknown"
    #: uplink payload bits per parameter per client-round over the run (derived)
    uplink_bits_per_param: float = field(default=math.nan, metadata=_METRIC)
    #: random freeze's "total density": the trained (kept) coordinates over the dense count,
    #: over every answering client-round (``RoundLog.keep_fraction`` weighted by the round's
    #: answering clients); nan in summaries older than the field
    total_density: float = field(default=math.nan, metadata=_METRIC)
    #: dp-level=user: the user-level epsilon at ``delta`` after the last round (None,
    #: ``null``: a sample-level run; older summaries wrote 0)
    user_epsilon: float | None = None
    #: the software that ran the server: fedsparse, flwr, opacus, torch (empty in summaries
    #: older than the field)
    versions: dict[str, str] = field(default_factory=dict)
    #: the shared header (module docstring); defaults: a summary older than it
    kind: RunKind = "federated"
    schema: int = 1
    command: str | None = None
    config_hash: str | None = None
    engine: str | None = None
    #: sigma over the run's rounds (``RoundLog.noise_multiplier_min``/``_max``)
    noise_multiplier_min: float | None = None
    noise_multiplier_max: float | None = None
    #: downlink payload bits per parameter per selected client-round over the run (derived)
    downlink_bits_per_param: float = field(default=math.nan, metadata=_METRIC)
    #: secure-aggregation=true: ``RoundLog.central_epsilon`` after the last round
    central_epsilon: float | None = None

    def __post_init__(self) -> None:
        for link in LINKS:
            total = getattr(self, f"total_{link}_payload_bytes")
            bits = uplink_bits_per_param(total, getattr(self, f"total_dense_{link}_bytes"))
            object.__setattr__(self, f"{link}_bits_per_param", bits)

    @classmethod
    def from_rounds(
        cls,
        logs: Sequence[RoundLog],
        *,
        parameters: int,
        delta: float,
        config: dict[str, Any],
        engine: str | None = None,
        command: str | None = None,
    ) -> Self:
        """The summary of a run whose rounds are ``logs`` (at least one).

        ``engine``: the DP engine the clients used ("auto" resolved; None: not known);
        ``command``: the command line that started the run (None: the Python API).
        """
        if not logs:
            raise ValueError("logs: expected at least one round")
        totals: dict[str, Any] = {
            f"total_{k}": int(sum(getattr(entry, k) for entry in logs)) for k in _TOTALS
        }
        up = totals["total_uplink_payload_bytes"]
        dense_up = totals["total_dense_uplink_bytes"]
        last = logs[-1]
        return cls(
            rounds=len(logs),
            parameters=parameters,
            final_test_accuracy=last.test_accuracy,
            final_test_loss=last.test_loss,
            epsilon_max=last.epsilon_max,
            epsilon_median=last.epsilon_median,
            delta=delta,
            **totals,
            uplink_savings=dense_up / up if up else math.nan,
            uplink_message_savings=(
                dense_up / totals["total_uplink_message_bytes"] if up else math.nan
            ),
            rejected_updates=int(sum(entry.num_rejected for entry in logs)),
            wall_seconds=sum(entry.wall_seconds for entry in logs),
            config=config,
            failed_rounds=sum(entry.failed for entry in logs),
            noise=run_noise([entry.noise for entry in logs]),
            total_density=_total_density(logs),
            user_epsilon=last.user_epsilon,
            central_epsilon=last.central_epsilon,
            **summary_header(
                "federated",
                config=config,
                command=command,
                engine=engine,
                noise_multiplier_min=_none_or(min, [e.noise_multiplier_min for e in logs]),
                noise_multiplier_max=_none_or(max, [e.noise_multiplier_max for e in logs]),
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``summary.json`` mapping (field order as declared)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """``summary.json``'s text."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_json(cls, data: str | Mapping[str, Any]) -> Self:
        """Parses ``summary.json`` (text or decoded mapping); extra keys are ignored."""
        mapping = json.loads(data) if isinstance(data, str) else data
        return _from_mapping(cls, mapping, "summary.json")  # type: ignore[no-any-return]


def record_command(path: Path, summary: RunSummary, command: str | None) -> RunSummary:
    """``summary`` with ``command`` set, written into the ``summary.json`` at ``path`` (by a
    launcher, once the run wrote it: the ServerApp may run in another process, which cannot
    know the command line); unchanged when ``command`` is None."""
    if command is None:
        return summary
    data = json.loads(Path(path).read_text())
    data["command"] = command
    write_atomically(path, json.dumps(data, indent=2) + "\n", mode=SHARED)
    return dataclasses.replace(summary, command=command)


def noise_range(sigmas: Sequence[float], *, private: bool) -> tuple[float | None, float | None]:
    """(min, max) of the calibrated sigmas; (None, None) when there is none or the mechanism
    is not private (its sigma is no privacy figure)."""
    if not private or not sigmas:
        return None, None
    return float(min(sigmas)), float(max(sigmas))


def _none_or(pick: Any, values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(pick(known)) if known else None


def _total_density(logs: Sequence[RoundLog]) -> float:
    """Kept coordinates over dense ones per answering client-round (nan: nobody answered)."""
    weights = [entry.dense_uplink_bytes for entry in logs]  # answering clients x d x 4
    total = sum(weights)
    if not total:
        return math.nan
    return sum(w * entry.keep_fraction for w, entry in zip(weights, logs, strict=True)) / total


def epsilon_stats(epsilons: Sequence[float]) -> tuple[float, float]:
    """(max, median) of the clients' epsilons so far; (0, 0) before any client reported."""
    values = list(epsilons) or [0.0]
    return max(values), float(statistics.median(values))


def round_noise(seeded: Sequence[int]) -> NoiseOrigin:
    """A round's ``noise`` from its accepted replies' ``seeded-noise`` flags (0/1)."""
    if not seeded:
        return "none"
    if all(seeded):
        return "seeded"
    return "mixed" if any(seeded) else "fresh"


def run_noise(rounds: Sequence[NoiseOrigin]) -> str:
    """A run's ``noise`` from its rounds' (see ``RunSummary.noise``)."""
    if any(r in ("seeded", "mixed") for r in rounds):
        return SEEDED_RUN
    if "unknown" in rounds:
        return "unknown"
    return "fresh" if "fresh" in rounds else "none"


def summary_metrics() -> tuple[str, ...]:
    """``RunSummary`` fields a sweep copies per run and averages over seeds."""
    return tuple(f.name for f in dataclasses.fields(RunSummary) if f.metadata.get("metric"))


def per_round_fields() -> tuple[str, ...]:
    """``RoundLog`` fields a sweep keeps per round and plots."""
    return tuple(f.name for f in dataclasses.fields(RoundLog) if f.metadata.get("per_round"))


def read_rounds(path: Path) -> list[RoundLog]:
    """Every complete line of a ``rounds.jsonl`` (empty if the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    return [RoundLog.from_json(line) for line in path.read_text().splitlines() if line.strip()]


#: The file a run that failed leaves its cause in, one line (beside its records).
FAILURE_FILE: Final = "failure.txt"


def one_line(text: str, *, limit: int = 400) -> str:
    """``text`` on one line: the first line of each ``; ``-separated part, at most ``limit``
    characters (a client's error may carry a traceback)."""
    parts = [part.strip().splitlines()[0] if part.strip() else "" for part in text.split("; ")]
    line = "; ".join(p for p in parts if p)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def untrained(rounds: Sequence[RoundLog]) -> str | None:
    """Why a run none of whose rounds accepted an update trained nothing (one line); None when
    some round accepted one (a round that sampled no user accepted none either)."""
    if not rounds or any(not entry.failed and entry.num_accepted > 0 for entry in rounds):
        return None
    last = rounds[-1]
    cause = f"the run trained nothing: none of its {len(rounds)} rounds accepted an update"
    cause += f"; round {last.round}: {last.failure or 'no client was sampled'}"
    if last.rejected:
        cause += f"; its first rejection: {last.rejected[0]}"
    return one_line(cause)
