"""Experiment tracking: a run's rounds in TensorBoard or MLflow, and a plot of each run.

``log=tensorboard`` writes TensorBoard event files under ``<out>/tensorboard`` (through
``torch.utils.tensorboard``; needs the ``tensorboard`` package, the ``tracking`` extra);
``log=mlflow`` logs to a local MLflow store, the SQLite file ``<out>/mlflow.db``
(``mlflow-skinny``, the same extra; ``mlflow ui --backend-store-uri sqlite:///<out>/mlflow.db``
shows it). Both get the run config as parameters (TensorBoard: as text) and, each round, the
scalars of ``ROUND_SCALARS`` at step = round: accuracy and loss, epsilon, bytes and bits
per parameter. Nothing is sent anywhere: both write files in the run's folder.

``plot_run`` draws the run's own picture, ``<out>/run.png``: test accuracy, epsilon and uplink
bytes per round, from ``rounds.jsonl`` alone (so ``fedsparse`` can redraw any finished run).

A tracker that fails (a missing package, a full disk) raises ``TrackingError`` at
construction, before the run starts; once the run is going, the run's own records
(``rounds.jsonl``) are the source of truth and a tracker's failure to write is reported, not
fatal (``Trackers.log_round``).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

from fedsparse.common.names import TRACKERS, TrackerName
from fedsparse.common.wire.run_log import RoundLog

__all__ = [
    "ROUND_SCALARS",
    "TRACKERS",
    "TrackerName",
    "Trackers",
    "TrackingError",
    "mlflow_uri",
    "parse_trackers",
    "plot_run",
    "plot_series",
    "read_rounds",
]


#: RoundLog fields logged each round (tracker name: field).
ROUND_SCALARS: Final[dict[str, str]] = {
    "accuracy/test": "test_accuracy",
    "loss/test": "test_loss",
    "loss/train": "train_loss",
    "privacy/epsilon_max": "epsilon_max",
    "privacy/epsilon_median": "epsilon_median",
    "privacy/user_epsilon": "user_epsilon",
    "privacy/central_epsilon": "central_epsilon",
    "bytes/uplink_payload": "uplink_payload_bytes",
    "bytes/downlink_payload": "downlink_payload_bytes",
    "bytes/uplink_bits_per_param": "uplink_bits_per_param",
    "bytes/downlink_bits_per_param": "downlink_bits_per_param",
    "sparsity/keep_fraction": "keep_fraction",
    "clients/accepted": "num_accepted",
    "time/round_seconds": "wall_seconds",
}


class TrackingError(RuntimeError):
    """A tracker cannot start (its package is missing, or its folder cannot be written)."""


class _Tracker(Protocol):
    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _scalars(entry: RoundLog) -> dict[str, float]:
    """The round's finite scalars (a figure that does not apply, None or NaN, is left out)."""
    out = {}
    for name, field in ROUND_SCALARS.items():
        value = getattr(entry, field, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


class _TensorBoard:
    def __init__(self, out: Path, config: Mapping[str, Any]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise TrackingError(
                f"log=tensorboard: {err}; install the tracking extra "
                "(pip install 'fedsparse[tracking]')"
            ) from None
        self._writer = SummaryWriter(log_dir=str(out / "tensorboard"))
        lines = "\n".join(f"    {key} = {value!r}" for key, value in sorted(config.items()))
        self._writer.add_text("run-config", lines, global_step=0)

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _MLflow:
    def __init__(self, out: Path, config: Mapping[str, Any]) -> None:
        try:
            import mlflow
        except ImportError as err:
            raise TrackingError(
                f"log=mlflow: {err}; install the tracking extra (pip install 'fedsparse[tracking]')"
            ) from None
        self._mlflow = mlflow
        out = out.resolve()
        out.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # MLflow's own deprecation notices
            self._client = mlflow.MlflowClient(tracking_uri=mlflow_uri(out))
            experiment = self._client.get_experiment_by_name("fedsparse")
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self._client.create_experiment(
                    "fedsparse", artifact_location=(out / "mlartifacts").as_uri()
                )
            )
            self._run = self._client.create_run(experiment_id, run_name=out.name)
        run_id = self._run.info.run_id
        for key, value in sorted(config.items()):
            self._client.log_param(run_id, key, str(value)[:500])

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        run_id = self._run.info.run_id
        for name, value in scalars.items():
            self._client.log_metric(run_id, name.replace("/", "."), value, step=step)

    def close(self) -> None:
        self._client.set_terminated(self._run.info.run_id)


def mlflow_uri(out: Path) -> str:
    """The MLflow tracking URI of the run in ``out``: a SQLite file, ``<out>/mlflow.db``
    (MLflow 3 keeps its plain-folder store in maintenance mode and refuses it by default)."""
    return f"sqlite:///{Path(out).resolve() / 'mlflow.db'}"


#: The package each tracker needs (the ``tracking`` extra).
_PACKAGES: Final = {"tensorboard": "tensorboard", "mlflow": "mlflow"}


def parse_trackers(log: str | Iterable[str], *, field: str = "log") -> list[TrackerName]:
    """The tracker names in ``log`` (comma-separated, or a list), checked without importing
    them: known names, each package installed.

    Raises:
        ValueError: an unknown name, or a tracker whose package is not installed.
    """
    import importlib.util

    names = [n.strip() for n in (log.split(",") if isinstance(log, str) else log) if n.strip()]
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise ValueError(f"{field}={','.join(names)!r}: expected some of {', '.join(TRACKERS)}")
    for name in names:
        if importlib.util.find_spec(_PACKAGES[name]) is None:
            raise ValueError(
                f"{field}={name}: the {_PACKAGES[name]} package is not installed; install "
                "the tracking extra (pip install 'fedsparse[tracking]')"
            )
    return names  # type: ignore[return-value]


_FACTORIES: Final[dict[str, type[_TensorBoard] | type[_MLflow]]] = {
    "tensorboard": _TensorBoard,
    "mlflow": _MLflow,
}


class Trackers:
    """The trackers a run logs to (none: every call does nothing).

    Args:
        names: ``TRACKERS`` members (the ``log`` setting, split on commas).
        out: the run's folder.
        config: the run config, logged once as the run's parameters.

    Raises:
        ValueError: an unknown tracker name.
        TrackingError: a tracker cannot start.
    """

    def __init__(self, names: Iterable[str], out: Path, config: Mapping[str, Any]) -> None:
        names = [name for name in names if name]
        unknown = [name for name in names if name not in TRACKERS]
        if unknown:
            raise ValueError(f"log={','.join(names)!r}: expected some of {', '.join(TRACKERS)}")
        self.names = names
        self._trackers: list[_Tracker] = [_FACTORIES[name](out, config) for name in names]
        self.failures: list[str] = []

    def log_round(self, entry: RoundLog) -> None:
        """Logs one federated round's ``ROUND_SCALARS`` at step = its round."""
        self.log_scalars(entry.round, _scalars(entry))

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Logs named scalars at ``step`` (non-finite ones are left out); a tracker that fails
        is noted in ``failures`` and dropped."""
        scalars = {name: float(v) for name, v in scalars.items() if math.isfinite(float(v))}
        for tracker in list(self._trackers):
            try:
                tracker.log_scalars(step, scalars)
            except Exception as err:  # noqa: BLE001 - rounds.jsonl stays the source of truth
                self.failures.append(f"{type(tracker).__name__.strip('_')}: {err}")
                self._trackers.remove(tracker)

    def close(self) -> None:
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []


def read_rounds(path: Path) -> list[RoundLog]:
    """The rounds of a ``rounds.jsonl`` (a line cut short by a kill is skipped)."""
    rounds = []
    for line in Path(path).read_text().splitlines():
        try:
            rounds.append(RoundLog.from_json(json.loads(line)))
        except (json.JSONDecodeError, ValueError, TypeError):
            continue
    return rounds


def plot_run(rounds: Sequence[RoundLog], path: Path, *, title: str = "") -> Path:
    """``path``: test accuracy, epsilon (max over clients) and uplink payload bytes per round,
    one panel each (failed rounds marked)."""
    return plot_series(
        [entry.round for entry in rounds],
        [
            ("test accuracy", [entry.test_accuracy for entry in rounds]),
            ("epsilon (max over clients)", [entry.epsilon_max for entry in rounds]),
            ("uplink payload bytes", [float(entry.uplink_payload_bytes) for entry in rounds]),
        ],
        path,
        xlabel="round",
        marked=[entry.failed for entry in rounds],
        title=title,
    )


def plot_series(
    steps: Sequence[int],
    panels: Sequence[tuple[str, Sequence[float]]],
    path: Path,
    *,
    xlabel: str,
    marked: Sequence[bool] | None = None,
    title: str = "",
) -> Path:
    """One panel per ``(label, values)`` against ``steps``; ``marked`` steps (failed rounds)
    drawn in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False)
    for ax, (label, values) in zip(axes[0], panels, strict=True):
        ax.plot(steps, values, marker="o", markersize=3)
        red = [(x, v) for x, v, m in zip(steps, values, marked or [], strict=False) if m]
        if red:
            ax.scatter(*zip(*red, strict=True), color="red", zorder=3, label="failed round")
            ax.legend(fontsize=7)
        ax.set_xlabel(xlabel)
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
