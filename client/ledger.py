"""The node's persistent privacy ledger: every noisy step its data ever took part in.

One JSON file per data set a node holds, ``<ledger-dir>/data-<sha256>.json``, kept across
rounds, runs and SuperNode restarts. The file is named by the *content* of the examples
(``client/node_data.py: data_identity``), never by a name the server chose: every name,
path, alias or seed that yields the same examples charges the same file. Each entry records
one round of local training: the run, the round, the mechanism and the accountant's
``(σ, q, steps)``. The ε spent is the Opacus accountant's composition of every entry at the
policy's δ, so runs compose as one long run.

``charge`` is the only way in and is all-or-nothing: under an exclusive lock on the file, it
refuses a round that is not strictly later than the run's last one (a replayed or reordered
request: the server could otherwise average away fresh noise by asking twice) or that would
take ε past the budget, and otherwise appends the entry and replaces the file atomically
(written to a temporary file, flushed to disk, renamed). The charge happens *before* the
data is touched: a crash after it spends budget that was not used, never the reverse.
Refusals say which limit was hit, never how much was spent (that depends on the data's
size and history); the details go to the node's own log (``PrivacyRefusal.detail``).

Ledgers written before the content key were named ``<dataset>-partition-<i>-of-<n>.json``
(``ledger_key``); a content-keyed ledger that does not exist yet starts from the entries of
the ``legacy`` files it is given, so an upgrade never resets a budget.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from fedsparse.client.node_policy import SECAGG, PrivacyRefusal, TrainingRequest
from fedsparse.common.atomic import PRIVATE, write_atomically
from fedsparse.common.dp.accounting import AccountantName, compute_epsilon_of_history
from fedsparse.common.dp.mechanisms import is_private

__all__ = ["LedgerEntry", "PrivacyLedger", "accounted", "ledger_key", "ledger_path"]

_FORMAT = 1


def accounted(
    mechanism: str, noise_multiplier: float, sample_rate: float, steps: int
) -> tuple[float, float, int] | None:
    """The accountant's ``(sigma, rate, steps)`` of one ledger round (None: not private).

    ``dpsgd`` rounds are as recorded. A ``secagg`` round records the node's worst-case
    multiplier on its clipped update (its own noise share, ``client/secagg_node.py``); one
    example moves that update by up to twice the clip, so its data sees half the multiplier.
    """
    if noise_multiplier == 0:
        return None
    if is_private(mechanism):
        return (noise_multiplier, sample_rate, steps)
    if mechanism == SECAGG:
        return (noise_multiplier / 2.0, sample_rate, steps)
    return None


def ledger_key(dataset: str, partition_id: int, num_partitions: int) -> str:
    """The file stem of a ledger written before the content key (``legacy`` ledgers)."""
    raw = f"{dataset}-partition-{partition_id}-of-{num_partitions}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", raw)


def ledger_path(ledger_dir: str | os.PathLike[str], identity: str) -> Path:
    """The ledger of the examples whose ``data_identity`` is ``identity``.

    Raises:
        ValueError: ``identity`` is not a SHA-256 hex digest.
    """
    if not re.fullmatch(r"[0-9a-f]{64}", identity):
        raise ValueError(f"identity={identity!r}: expected a SHA-256 hex digest")
    return Path(ledger_dir).expanduser() / f"data-{identity}.json"


@dataclass(frozen=True)
class LedgerEntry:
    """One round of local training on this data."""

    run_id: int
    server_round: int
    mechanism: str
    noise_multiplier: float
    sample_rate: float
    steps: int
    #: GIP's index selection this round (pure DP; absent in ledgers written before it: 0).
    index_epsilon: float = 0.0


class PrivacyLedger:
    """The ledger file at ``path`` (created on the first charge).

    Args:
        legacy: ledgers of the same data under older names: until ``path`` exists, its
            entries are theirs (and the first charge writes them all to ``path``).
    """

    def __init__(
        self,
        path: Path,
        *,
        accountant: AccountantName = "rdp",
        legacy: Sequence[Path] = (),
    ) -> None:
        self.path = Path(path).expanduser()
        self.accountant = accountant
        self.legacy = tuple(Path(p).expanduser() for p in legacy)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def entries(self) -> list[LedgerEntry]:
        """Every recorded round, oldest first (the legacy files' until ``path`` exists)."""
        if self.path.exists():
            return _read(self.path)
        return [entry for path in self.legacy if path.exists() for entry in _read(path)]

    def epsilon(self, delta: float, extra: LedgerEntry | None = None) -> float:
        """ε spent at ``delta`` (with ``extra`` added); inf once any non-DP round is in.

        The accountant's ε of the Gaussian rounds plus the pure ε of GIP's index selections
        (basic composition, GIP Thm. 2)."""
        entries = [*self.entries(), *([extra] if extra else [])]
        history = [
            accounted(e.mechanism, e.noise_multiplier, e.sample_rate, e.steps) for e in entries
        ]
        if any(h is None for h in history):
            return math.inf
        gaussian = compute_epsilon_of_history(
            [h for h in history if h is not None], delta=delta, accountant=self.accountant
        )
        return gaussian + sum(e.index_epsilon for e in entries)

    def charge(self, request: TrainingRequest, *, budget: float, delta: float) -> float:
        """Records ``request`` if it is a new round and fits the budget; returns ε after it.

        Raises:
            PrivacyRefusal: a round not after the run's last one, or ε past ``budget``.
        """
        entry = LedgerEntry(
            run_id=request.run_id,
            server_round=request.server_round,
            mechanism=request.mechanism,
            noise_multiplier=request.noise_multiplier,
            sample_rate=request.sample_rate,
            steps=request.steps,
            index_epsilon=request.index_epsilon,
        )
        with self._locked():
            entries = self.entries()
            done = [e.server_round for e in entries if e.run_id == request.run_id]
            if done and request.server_round <= max(done):
                raise PrivacyRefusal(
                    f"round={request.server_round}: this node already trained round "
                    f"{max(done)} of run {request.run_id}; rounds must strictly increase"
                )
            spent = self.epsilon(delta, extra=entry)
            if spent > budget:
                raise PrivacyRefusal(
                    "this round would take the node's data past its privacy budget",
                    detail=f"epsilon={spent:.4g} at delta={delta:g} after this round, budget "
                    f"{budget:g}, spent so far {self.epsilon(delta):.4g} ({self.path})",
                )
            self._write([*entries, entry])
        return spent

    def release_once(self, run_id: int, round_id: int) -> None:
        """Secure aggregation's one masked input per round, held beside the ledger under its
        lock (``<ledger>.released.json``), not in ``Context.state``: two copies of a collect
        message handled at once both read the same state, so only this file can tell the
        second it comes too late.

        Raises:
            PrivacyRefusal: this run's round already released (or began to release) one.
        """
        path = self.path.with_suffix(".released.json")
        with self._locked():
            done = json.loads(path.read_text()) if path.exists() else []
            if [run_id, round_id] in done:
                raise PrivacyRefusal(
                    f"round={round_id}: this node already released its masked input for "
                    f"round {round_id} of run {run_id}"
                )
            write_atomically(path, json.dumps([*done, [run_id, round_id]]), mode=PRIVATE)

    def answer_once(
        self,
        run_id: int,
        round_id: int,
        stage: str,
        value: str = "",
        *,
        nonce: bytes = b"",
        binds: str = "",
        again: bool = True,
    ) -> None:
        """Secure aggregation's later answers of a round, held as ``release_once`` holds its
        masked input (``<ledger>.answered.json``): one survivor set signed per round (the same
        set again is the same signature's content: ``again``) and one unmask answer (``again``
        False: not even the same one twice). ``binds``: a stage
        of the same round whose answer, if given, must have had this ``value`` (the unmask
        answers only for the survivor set the node signed, and the other way round, however
        the two messages reached copies of the node's state). With ``nonce`` (the server's
        for the round) the answers are held by ``(round_id, nonce)`` across every run: what a
        node signs names the round and the nonce, not the run, so a server that reuses both in
        another run must not get a second set signed (a reviewer's replay).

        Raises:
            PrivacyRefusal: this run's round already answered ``stage`` (with another value),
                or ``binds`` with another value.
        """
        path = self.path.with_suffix(".answered.json")
        scope = f"{round_id}/{nonce.hex()}" if nonce else f"{run_id}/{round_id}"
        key, bound = f"{scope}/{stage}", f"{scope}/{binds}"
        with self._locked():
            done = json.loads(path.read_text()) if path.exists() else {}
            if key in done and (not again or not value or done[key] != value):
                raise PrivacyRefusal(
                    f"round={round_id}: this node already answered stage {stage!r} of round "
                    f"{round_id} of run {run_id}"
                )
            if binds and bound in done and done[bound] != value:
                raise PrivacyRefusal(
                    f"round={round_id}: stage {stage!r} names another survivor set than the "
                    f"node's answer to stage {binds!r} of round {round_id} of run {run_id}"
                )
            write_atomically(path, json.dumps({**done, key: value}), mode=PRIVATE)

    def _write(self, entries: list[LedgerEntry]) -> None:
        payload = {"format": _FORMAT, "entries": [asdict(e) for e in entries]}
        write_atomically(self.path, json.dumps(payload, indent=1), mode=PRIVATE)


def _read(path: Path) -> list[LedgerEntry]:
    try:
        data = json.loads(path.read_text())
        if data.get("format") != _FORMAT:
            raise ValueError(f"format={data.get('format')!r}: expected {_FORMAT}")
        return [LedgerEntry(**entry) for entry in data["entries"]]
    except (OSError, ValueError, TypeError, KeyError) as err:
        # A damaged or unreadable ledger must not read as an empty one (a fresh budget); its
        # path (the data's digest) and the error stay in the node's log.
        raise PrivacyRefusal(
            "this node's privacy ledger is unreadable; refusing",
            detail=f"ledger {path}: unreadable ({err})",
        ) from None
