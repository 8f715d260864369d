"""A run folder is never silently overwritten, mixed or resumed with other numbers.

Every command that writes a run folder (``fedsparse simulate``, ``demo``, ``deploy``,
``train``; each run of ``sweep``, ``frontier`` and ``reproduce``) first calls ``claim``:

* a folder that holds no run (missing, empty, or only files no fedsparse command writes) is
  used as it is;
* one that holds a run, finished or not (any of ``RUN_ENTRIES``: records, checkpoint, logs,
  node states, ledgers, trackers' stores), is refused, unless the command was given
  ``--resume`` (continue it) or ``--overwrite``: the latter removes every entry of the old
  run, logs included, before anything new is written, and leaves other files alone.

A resumed run must be the same run: ``RunInputs`` are what changes a run's numbers outside its
run config (client count, the backend's family of results, the data's content, the plug-ins'
code), written to ``INPUTS_FILE`` when the run starts and compared on ``--resume``; the run
config itself is compared with the checkpoint's (``server/checkpoint.py``). Every difference
is refused naming the input and both values. Pure Python (no Flower).
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from fedsparse.common import plugins
from fedsparse.server.launch_markers import STOP_FILE

__all__ = [
    "INPUTS_FILE",
    "RESULT_FAMILIES",
    "RUN_ENTRIES",
    "RunFolderError",
    "RunInputs",
    "check_inputs",
    "claim",
    "claim_runs",
    "data_digest",
    "plugin_version",
    "run_entries",
    "write_inputs",
]

#: The inputs of the run in a folder, beside its records (``RunInputs``).
INPUTS_FILE: Final = "run-inputs.json"

#: What fedsparse writes into a run folder: records and checkpoint, logs, the run's
#: ``FLWR_HOME`` and app bundle, node states and ledgers, a deployment's keys and
#: certificates, the trackers' stores, saved updates, a sweep run's record (glob patterns).
RUN_ENTRIES: Final = (
    "rounds.jsonl",
    "summary.json",
    "checkpoint.pt",
    "epochs.jsonl",
    "model.pt",
    "run.png",
    "wire.json",
    "nodes.json",
    "failure.txt",
    INPUTS_FILE,
    "*.log",
    ".flwr",
    ".app",
    "node-state",
    "ledgers",
    "keys",
    "certs",
    "updates",
    "tensorboard",
    "mlflow.db*",
    "mlartifacts",
    "mlruns",
    "sweep-run.json",
    "error.txt",
    "spec.json",
)

#: Backends whose runs end with the same numbers (bit for bit, tested), by family: a run may
#: resume on another backend of its family only.
RESULT_FAMILIES: Final[Mapping[str, str]] = {
    "flower": "simulation",
    "ray": "simulation",
    "inprocess": "simulation",
    "deploy": "deployment",
    # float32-close to the simulation family, not bit for bit (client/population.py)
    "population": "population",
    "ray-population": "population",  # the same vectorised step, on Ray workers
}


class RunFolderError(ValueError):
    """A run folder that holds a run, or a resume whose inputs differ (named)."""


def run_entries(out: Path) -> list[Path]:
    """The entries of ``out`` that belong to a run (``RUN_ENTRIES``), sorted."""
    out = Path(out)
    if not out.is_dir():
        return []
    return sorted(
        entry
        for entry in out.iterdir()
        if any(fnmatch.fnmatchcase(entry.name, pattern) for pattern in RUN_ENTRIES)
    )


def claim(
    out: Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    what: str = "out",
    resumable: bool = True,
) -> None:
    """Readies ``out`` for a run: refuses one that holds a run unless ``resume`` or
    ``overwrite``; ``overwrite`` first removes every entry of the old run (and a stale stop
    marker). ``resumable``: the command has a ``--resume`` to name in the refusal.

    Raises:
        RunFolderError: ``out`` holds a run and neither flag was given, or both were.
    """
    if resume and overwrite:
        raise RunFolderError("--resume and --overwrite: give one (continue the run, or replace it)")
    found = run_entries(out)
    if not found or resume:
        return
    if not overwrite:
        names = ", ".join(entry.name for entry in found[:4]) + (", ..." if len(found) > 4 else "")
        how = "give --resume to continue it or --overwrite" if resumable else "give --overwrite"
        raise RunFolderError(
            f"{what}={out}: holds a run ({names}): {how} to replace it (its files are removed "
            "first), or another folder"
        )
    for entry in [*found, Path(out) / STOP_FILE]:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)


#: A run folder inside a runs-dir: it holds one of these (``claim_runs``).
_RUN_RECORDS: Final = (
    "summary.json",
    "sweep-run.json",
    "spec.json",
    "error.txt",
    "rounds.jsonl",
    "epochs.jsonl",
    "checkpoint.pt",
    "flwr.log",
    INPUTS_FILE,
)


def claim_runs(runs_dir: Path, *, resume: bool = False, overwrite: bool = False) -> None:
    """``claim`` for a command that writes many run folders under ``runs_dir`` (``sweep``,
    ``frontier``, ``reproduce``): one that holds runs is refused unless ``resume`` (finished
    runs of the same inputs are reused; one of other inputs is refused, not rerun over) or
    ``overwrite`` (every run folder under it is emptied of its run's files first).

    Raises:
        RunFolderError: ``runs_dir`` holds runs and neither flag was given, or both were.
    """
    if resume and overwrite:
        raise RunFolderError("--resume and --overwrite: give one (reuse the runs, or replace them)")
    runs_dir = Path(runs_dir)
    folders = sorted(
        {path.parent for name in _RUN_RECORDS for path in runs_dir.rglob(name)}
        if runs_dir.is_dir()
        else set()
    )
    if not folders or resume:
        return
    if not overwrite:
        raise RunFolderError(
            f"runs-dir={runs_dir}: holds {len(folders)} runs of an earlier command: give "
            "--resume to reuse the finished ones (a run of other inputs is refused, by name) or "
            "--overwrite to start over (their files are removed first), or another folder"
        )
    for folder in folders:
        claim(folder, overwrite=True)
        if folder != runs_dir and not any(folder.iterdir()):
            folder.rmdir()


@dataclass(frozen=True, kw_only=True)
class RunInputs:
    """What changes a run's numbers outside its run config."""

    clients: int
    #: the backend's ``RESULT_FAMILIES`` entry (its name where it has none)
    results: str
    #: SHA-256 of the dataset's training and evaluation examples (``data_digest``)
    data: str
    #: each plug-in reference of the run config, with its code's version (``plugin_version``)
    plugins: dict[str, str] = field(default_factory=dict)
    #: the DP engine the clients train with ("auto" resolved: it depends on the device)
    engine: str = ""

    @classmethod
    def of_run(
        cls,
        *,
        clients: int,
        backend: str,
        data: str,
        run_config: Mapping[str, Any],
        engine: str = "",
    ) -> RunInputs:
        """The inputs of a run of ``run_config`` (kebab-case keys). The backends of a family of
        results give the same numbers only when every client trains every round: under
        ``clients-per-round`` below the client count the backend's own name is recorded
        (Flower gives its simulated nodes random ids, and sampling goes by id)."""
        named = {**run_config, "backend": backend}
        versions = {
            key: f"{value} @ {plugin_version(str(value))}"
            for key, value in sorted(named.items())
            if key in _VERSIONED and plugins.is_reference(str(value))
        }
        every = int(run_config.get("clients-per-round", 0) or 0) in (0, clients)
        results = RESULT_FAMILIES.get(backend, backend) if every else backend
        return cls(clients=clients, results=results, data=data, plugins=versions, engine=engine)


#: The inputs that may name a user's code, whose version a run's inputs record.
_VERSIONED: Final = ("backend", "dataset", "engine", "method", "model")


def plugin_version(reference: str) -> str:
    """The version of a plug-in's code: its distribution's version where it is installed from
    one, and the SHA-256 of its module's source file (an editable install changes that without
    a new version); ``unknown`` where neither is found. Finds the module without importing it
    (its parent packages are imported)."""
    module = reference.split(":", 1)[0]
    top = module.split(".", 1)[0]
    parts = []
    for dist in importlib.metadata.packages_distributions().get(top, []):
        try:
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin and Path(spec.origin).is_file():
        parts.append("sha256:" + hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()[:16])
    return " ".join(parts) or "unknown"


def write_inputs(out: Path, inputs: RunInputs) -> None:
    """Records ``inputs`` in ``out`` (a new run)."""
    (Path(out) / INPUTS_FILE).write_text(json.dumps(asdict(inputs), indent=2) + "\n")


def check_inputs(out: Path, inputs: RunInputs) -> None:
    """Refuses to resume the run in ``out`` with other ``inputs`` than it started with.

    Raises:
        RunFolderError: an input differs (named, with both values), or none were recorded (a
            run that another command started, or an earlier fedsparse), or the file is
            unreadable.
    """
    path = Path(out) / INPUTS_FILE
    if not path.exists():
        raise RunFolderError(
            f"resume: {out} records no run inputs ({INPUTS_FILE}): the run was not started by "
            "fedsparse simulate (a sweep's run, a deployment, flwr run) or by an earlier "
            "version, so its clients, data and plug-ins cannot be checked; start it anew "
            "(--overwrite)"
        )
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise RunFolderError(f"resume: {path}: unreadable ({type(err).__name__})") from None
    names = {
        "clients": "clients",
        "results": "backend",
        "data": "data",
        "plugins": "plug-ins",
        "engine": "engine",
    }
    for key, value in asdict(inputs).items():
        old = saved.get(key)
        if old != value:
            label = names[key]
            if key == "data":
                old, value = f"sha256 {str(old)[:12]}...", f"sha256 {str(value)[:12]}..."
            raise RunFolderError(
                f"resume: {label}={value!r}, but the run in {out} started with "
                f"{label}={old!r}: a resumed run keeps every input that changes its numbers "
                "(start a new run, or resume with the same)"
            )


def data_digest(*splits: Any) -> str:
    """SHA-256 over the examples of ``splits`` (``client/node_data.py: data_identity`` each)."""
    from fedsparse.client.node_data import data_identity

    digest = hashlib.sha256()
    for split in splits:
        digest.update(data_identity(split).encode())
    return digest.hexdigest()
