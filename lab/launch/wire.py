"""On-the-wire bytes of a loopback deployment, per round, next to payload and message bytes.

Three byte counts per round and direction, from the innermost out:

* payload: the ``SparseUpdate`` bytes (``rounds.jsonl``: ``*_payload_bytes``);
* message: the serialized Flower messages (``*_message_bytes``), before gRPC framing;
* wire: what ``ByteRelay`` (``lab/launch/relay.py``) read from the TCP streams between the
  SuperNodes and the SuperLink's Fleet API: gRPC/HTTP2 framing and headers, every RPC of the
  object protocol (pull, push, confirm), the SuperNodes' polling and heartbeats, and under
  TLS the record framing and handshakes. Not TCP/IP headers or ACKs.

``capture_summary`` builds ``wire.json`` (``run_deployment`` writes it); ``wire_report`` joins
it with ``rounds.jsonl``; ``wire_table`` and ``write_wire_csv`` present the join.

Windows (``wire.json``): the relay stamps each chunk with ``time.time()`` when it reads it and
the ServerApp writes ``started_at``/``ended_at`` with ``time.time()``, on the same machine and
so the same clock. Time is cut into consecutive half-open windows, so every relayed byte lands
in exactly one of them and they sum to the relay totals:

* ``setup``: before round 1's ``started_at`` (connection, registration, idle polling while
  waiting for ``flwr run``, the run's start). The SuperNodes fetch the run and the app bundle
  (FAB) when they pull their first message, which is inside round 1's window, not here
  (``fab_bytes``: the bundle's size, built from the same files just before the run);
* round ``k``: ``[started_at_k, ended_at_k)``, everything the round's messages cost plus the
  polling that happened meanwhile; ``idle_*_estimate`` is that polling, estimated as the idle
  rate times the round's duration;
* ``between`` round ``k`` and ``k+1``: ``[ended_at_k, started_at_{k+1})`` (the ServerApp
  writes its line, then starts the next round: normally milliseconds);
* ``teardown``: from the last round's ``ended_at`` on (the run's end, the SuperNodes' exit).

The idle rate is measured before ``flwr run``, with every SuperNode connected and polling
(every 3 s, plus a heartbeat every ~24 s), over ``idle.seconds``; short windows quantize it.
"""

from __future__ import annotations

import csv
import errno
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from fedsparse.common.wire.run_log import LINKS, Link, RoundLog, read_rounds
from fedsparse.lab.launch.relay import DIRECTIONS, Direction, Record

__all__ = [
    "REPORT_FIELDS",
    "capture_lines",
    "capture_summary",
    "wire_report",
    "wire_table",
    "write_wire_csv",
]

CLOCK_NOTE = (
    "relay records and rounds.jsonl started_at/ended_at are time.time() on the same machine"
)
WINDOW_NOTE = (
    "setup=[-inf, started_at_1), round k=[started_at_k, ended_at_k), "
    "between k=[ended_at_k, started_at_k+1), teardown=[ended_at_last, inf)"
)
#: The relay's direction of each link: a SuperNode's uplink is what it sends (``up``).
_LINKS: dict[Direction, Link] = dict(zip(DIRECTIONS, LINKS, strict=True))


def _bytes(records: Sequence[Record], t0: float, t1: float) -> dict[str, int]:
    sums: dict[str, int] = dict.fromkeys(DIRECTIONS, 0)
    for record in records:
        if t0 <= record.time < t1:
            sums[record.direction] += record.nbytes
    return sums


def _rates(records: Sequence[Record], idle: tuple[float, float] | None) -> dict[str, float] | None:
    if idle is None or idle[1] <= idle[0]:
        return None
    seconds = idle[1] - idle[0]
    return {f"{d}_bytes_per_s": n / seconds for d, n in _bytes(records, idle[0], idle[1]).items()}


def _categorize(
    records: Sequence[Record], rounds: Sequence[RoundLog], idle: dict[str, float] | None
) -> dict[str, Any]:
    """Bytes per window (see the module docstring) for one stream of records."""
    starts = [float(r.started_at) for r in rounds]
    ends = [float(r.ended_at) for r in rounds]
    per_round = []
    for k, entry in enumerate(rounds):
        seconds = ends[k] - starts[k]
        row: dict[str, Any] = {
            "round": int(entry.round),
            "started_at": starts[k],
            "ended_at": ends[k],
            "seconds": seconds,
            **_bytes(records, starts[k], ends[k]),
        }
        for d in DIRECTIONS:
            row[f"idle_{d}_estimate"] = idle[f"{d}_bytes_per_s"] * seconds if idle else None
        if k + 1 < len(rounds):
            row["between"] = {
                "seconds": starts[k + 1] - ends[k],
                **_bytes(records, ends[k], starts[k + 1]),
            }
        per_round.append(row)
    return {
        "total": _bytes(records, -math.inf, math.inf),
        "idle": idle,
        "setup": _bytes(records, -math.inf, starts[0] if starts else math.inf),
        "rounds": per_round,
        "teardown": _bytes(records, ends[-1], math.inf) if ends else dict.fromkeys(DIRECTIONS, 0),
    }


def capture_summary(
    records: Sequence[Sequence[Record]],
    rounds: Sequence[RoundLog],
    *,
    idle: tuple[float, float] | None,
    capture: tuple[float, float],
    tls: bool,
    relays: Sequence[str] | None = None,
    connections: Sequence[int] | None = None,
    fab_bytes: int | None = None,
) -> dict[str, Any]:
    """The content of ``wire.json``: wire bytes per node and in total, by window.

    Args:
        records: one relay's time series per SuperNode.
        rounds: ``rounds.jsonl``'s rounds, in order (their ``started_at`` and ``ended_at``
            cut the windows).
        idle: the idle measurement window ``(t0, t1)`` (unix times), or None if not measured.
        capture: when the relays started and stopped (unix times).
        tls: whether the relays carried TLS.
        relays: each relay's listening address (for the record).
        connections: TCP connections each relay accepted.
        fab_bytes: size of the app bundle each SuperNode fetched in round 1, if known.

    Returns:
        ``{"tls", "clock", "windows", "capture", "idle_window", "nodes": [...], "total"}``;
        each node and the total hold ``total``, ``idle`` (bytes/s up and down, None if not
        measured), ``setup``, ``rounds`` (bytes up/down, duration, idle estimates and the
        ``between`` bucket to the next round) and ``teardown``. The total's idle rates are
        the sums of the nodes'.
    """
    rates = [_rates(node, idle) for node in records]
    nodes = []
    for i, node in enumerate(records):
        entry: dict[str, Any] = {"node": i}
        if relays is not None:
            entry["relay"] = relays[i]
        if connections is not None:
            entry["connections"] = connections[i]
        nodes.append({**entry, **_categorize(node, rounds, rates[i])})
    total_rate = None
    if idle is not None and records and all(r is not None for r in rates):
        total_rate = {
            key: sum(r[key] for r in rates if r is not None)
            for key in ("up_bytes_per_s", "down_bytes_per_s")
        }
    merged = [record for node in records for record in node]
    return {
        "tls": tls,
        "fab_bytes": fab_bytes,
        "clock": CLOCK_NOTE,
        "windows": WINDOW_NOTE,
        "capture": {"started_at": capture[0], "stopped_at": capture[1]},
        "idle_window": (
            None
            if idle is None
            else {"started_at": idle[0], "ended_at": idle[1], "seconds": idle[1] - idle[0]}
        ),
        "nodes": nodes,
        "total": _categorize(merged, rounds, total_rate),
    }


#: Columns of ``wire_report`` rows (and of ``wire_report.csv``), in order.
REPORT_FIELDS = (
    "round",
    "seconds",
    *(
        f"{link}_{field}"
        for link in LINKS
        for field in (
            "payload_bytes",
            "message_bytes",
            "wire_bytes",
            "dense_bytes",
            "payload_vs_dense",
            "message_vs_dense",
            "wire_vs_dense",
            "message_vs_payload",
            "wire_vs_message",
            "idle_estimate_bytes",
        )
    ),
    "wire_captured",
    "tls",
)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _report_row(
    entry: RoundLog, wire: Mapping[str, Any] | None, tls: bool | None
) -> dict[str, Any]:
    row: dict[str, Any] = {"round": int(entry.round), "seconds": entry.wall_seconds}
    for d, link in _LINKS.items():
        payload = entry.payload_bytes(link)
        message = entry.message_bytes(link)
        dense = entry.dense_bytes(link)
        on_wire = None if wire is None else wire[d]
        row[f"{link}_payload_bytes"] = payload
        row[f"{link}_message_bytes"] = message
        row[f"{link}_wire_bytes"] = on_wire
        row[f"{link}_dense_bytes"] = dense
        row[f"{link}_payload_vs_dense"] = _ratio(payload, dense)
        row[f"{link}_message_vs_dense"] = _ratio(message, dense)
        row[f"{link}_wire_vs_dense"] = _ratio(on_wire, dense)
        row[f"{link}_message_vs_payload"] = _ratio(message, payload)
        row[f"{link}_wire_vs_message"] = _ratio(on_wire, message)
        row[f"{link}_idle_estimate_bytes"] = None if wire is None else wire[f"idle_{d}_estimate"]
    if wire is not None:
        row["seconds"] = wire["seconds"]
    row["wire_captured"] = wire is not None
    row["tls"] = tls
    return row


def wire_report(run_dir: Path) -> list[dict[str, Any]]:
    """Per round: payload, message and wire bytes up and down, and their ratios.

    Ratios: ``*_vs_dense`` divide by the dense fp32 baseline of the round (``dense_*_bytes``:
    ``4 d`` per reply up, per selected client down); ``message_vs_payload`` and
    ``wire_vs_message`` are the overheads of each layer. Without ``wire.json`` (a simulation
    run), every wire field is None and ``wire_captured`` is False.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``rounds.jsonl``.
    """
    run_dir = Path(run_dir)
    rounds_path = run_dir / "rounds.jsonl"
    if not rounds_path.exists():
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(rounds_path))
    rounds = read_rounds(rounds_path)
    wire_path = run_dir / "wire.json"
    capture = json.loads(wire_path.read_text()) if wire_path.exists() else None
    by_round = {r["round"]: r for r in capture["total"]["rounds"]} if capture else {}
    tls = capture["tls"] if capture else None
    return [_report_row(entry, by_round.get(entry.round), tls) for entry in rounds]


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def wire_table(rows: Sequence[Mapping[str, Any]], *, title: str = "bytes per round") -> Table:
    """A rich table of ``wire_report`` rows: one line per round and direction."""
    table = Table(title=title)
    for name in ("round", "link", "payload B", "message B", "wire B", "idle est. B"):
        table.add_column(name, justify="right")
    for name in ("payload/dense", "message/dense", "wire/dense", "wire/message"):
        table.add_column(name, justify="right")
    for row in rows:
        for d, link in _LINKS.items():
            idle = row[f"{link}_idle_estimate_bytes"]
            table.add_row(
                str(row["round"]) if d == "up" else "",
                d,
                _count(row[f"{link}_payload_bytes"]),
                _count(row[f"{link}_message_bytes"]),
                _count(row[f"{link}_wire_bytes"]),
                "-" if idle is None else f"{idle:,.0f}",
                *(
                    _times(row[f"{link}_{ratio}"])
                    for ratio in ("payload_vs_dense", "message_vs_dense", "wire_vs_dense")
                ),
                _times(row[f"{link}_wire_vs_message"]),
                end_section=d == "down",
            )
    if rows and not rows[0]["wire_captured"]:
        table.caption = "wire bytes were not captured (no wire.json: not a relayed deployment)"
    elif rows:
        table.caption = (
            "wire: TLS ciphertext" if rows[0]["tls"] else "wire: plaintext gRPC"
        ) + "; dense = fp32 baseline (4 d bytes per reply up, per client down)"
    return table


def write_wire_csv(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Writes ``rows`` (``REPORT_FIELDS`` columns; None as empty) to ``path``; returns it."""
    with Path(path).open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=REPORT_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row[k] for k in REPORT_FIELDS})
    return Path(path)


def capture_lines(run_dir: Path) -> list[str]:
    """Human-readable idle rates and setup bytes from ``<run_dir>/wire.json`` (empty if none)."""
    path = Path(run_dir) / "wire.json"
    if not path.exists():
        return ["wire bytes were not captured (no wire.json: not a relayed deployment)"]
    capture = json.loads(path.read_text())
    lines = []
    for node in [*capture["nodes"], {"node": "all", **capture["total"]}]:
        idle = node["idle"]
        rate = (
            "not measured"
            if idle is None
            else f"{idle['up_bytes_per_s']:,.1f} B/s up, {idle['down_bytes_per_s']:,.1f} B/s down"
        )
        setup, total = node["setup"], node["total"]
        lines.append(
            f"node {node['node']}: idle {rate}; setup {setup['up']:,} B up, "
            f"{setup['down']:,} B down; total {total['up']:,} B up, {total['down']:,} B down"
        )
    if capture.get("fab_bytes"):
        lines.append(
            f"round 1 downlink includes each SuperNode's app bundle (FAB) download, "
            f"{capture['fab_bytes']:,} B per node"
        )
    return lines
