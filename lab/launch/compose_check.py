"""The check that a containerised run ran like a simulation of the same run config.

``compare_rounds`` compares two runs' ``rounds.jsonl`` round by round: the payload byte counts
(``EXACT_FIELDS``) must be identical, the serialized Flower messages (``MESSAGE_FIELDS``) may
differ by ``MESSAGE_SLACK`` bytes per message. ``compare_dirs`` prints the comparison of two
run directories: ``python -m fedsparse.lab.launch.compose --compare DEPLOYED SIM``
(``scripts/test-containers.sh``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedsparse.common.wire.run_log import RoundLog, read_rounds

__all__ = [
    "EXACT_FIELDS",
    "MESSAGE_FIELDS",
    "MESSAGE_SLACK",
    "RoundComparison",
    "compare_dirs",
    "compare_rounds",
]


#: Per-round fields a containerised run and a simulation of one run config must share exactly:
#: payload sizes are functions of ``d``, ``keep``, the round and the seeds.
EXACT_FIELDS = (
    "round",
    "num_clients",
    "num_replies",
    "num_rejected",
    "keep",
    "uplink_payload_bytes",
    "downlink_payload_bytes",
    "dense_uplink_bytes",
    "dense_downlink_bytes",
)
#: Serialized Flower messages also carry node ids, run ids and metadata whose encodings vary
#: in length between runs (varint node ids), so these may differ by a few bytes per message.
MESSAGE_FIELDS = ("uplink_message_bytes", "downlink_message_bytes")
#: Bytes per message that ``MESSAGE_FIELDS`` may differ by.
MESSAGE_SLACK = 100


@dataclass(frozen=True)
class RoundComparison:
    """How a deployed run's ``rounds.jsonl`` compares with a simulation's."""

    problems: list[str]  # disagreements beyond the tolerances; empty: they agree
    differences: list[str]  # every field that is not byte-identical, within tolerance or not
    table: list[str]  # per round: the compared byte counts, deployed / simulated

    @property
    def agree(self) -> bool:
        """Same rounds, identical ``EXACT_FIELDS``, ``MESSAGE_FIELDS`` within tolerance."""
        return not self.problems

    @property
    def identical(self) -> bool:
        """Every compared field identical, message sizes included."""
        return not self.differences


def compare_rounds(
    deployed: Sequence[RoundLog],
    simulated: Sequence[RoundLog],
    *,
    message_slack: int = MESSAGE_SLACK,
) -> RoundComparison:
    """Compares two runs of one run config round by round (``EXACT_FIELDS``, ``MESSAGE_FIELDS``).

    A message field may differ by ``message_slack`` bytes per message: replies for the
    uplink, selected clients for the downlink. Differing round counts are a problem.

    Args:
        deployed: the containerised (or loopback) run's rounds.
        simulated: the simulation's rounds.
        message_slack: tolerated bytes per message for ``MESSAGE_FIELDS``.
    """
    problems, differences, table = [], [], []
    if len(deployed) != len(simulated):
        problems.append(f"rounds: {len(deployed)} deployed, {len(simulated)} simulated")
        differences.append(problems[-1])
    for dep, sim in zip(deployed, simulated, strict=False):
        where = f"round {sim.round}"
        for name in EXACT_FIELDS:
            mine, theirs = getattr(dep, name), getattr(sim, name)
            if mine != theirs:
                problems.append(f"{where}: {name} {mine} deployed, {theirs} simulated")
                differences.append(problems[-1])
        for name, messages in zip(MESSAGE_FIELDS, (sim.num_replies, sim.num_clients), strict=True):
            mine, theirs = getattr(dep, name), getattr(sim, name)
            if mine == theirs:
                continue
            line = f"{where}: {name} {mine} deployed, {theirs} simulated ({mine - theirs:+d} B)"
            differences.append(line)
            if abs(mine - theirs) > message_slack * max(messages, 1):
                problems.append(f"{line}: beyond {message_slack} B x {messages} messages")
        table.append(
            f"{where}: "
            + ", ".join(
                f"{name.removesuffix('_bytes')} {getattr(dep, name)}/{getattr(sim, name)}"
                for name in ("uplink_payload_bytes", *MESSAGE_FIELDS[:1])
                + ("downlink_payload_bytes", *MESSAGE_FIELDS[1:])
            )
        )
    return RoundComparison(problems=problems, differences=differences, table=table)


def compare_dirs(deployed: Path, simulated: Path) -> int:
    """Prints how two run directories' ``rounds.jsonl`` compare; 0 if they agree, else 1."""
    result = compare_rounds(
        read_rounds(deployed / "rounds.jsonl"), read_rounds(simulated / "rounds.jsonl")
    )
    print("bytes per round, deployed/simulated:")
    print("\n".join(f"  {line}" for line in result.table))
    if result.identical:
        print("identical: every compared field, message sizes included")
    else:
        print("not identical:\n" + "\n".join(f"  {line}" for line in result.differences))
    if result.agree:
        print("agree: same rounds, identical payload bytes, message bytes within tolerance")
        return 0
    print("MISMATCH:\n" + "\n".join(f"  {line}" for line in result.problems), file=sys.stderr)
    return 1
