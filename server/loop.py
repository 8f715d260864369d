"""The ServerApp's round loop: the ``SparseFedAvg`` strategy plus evaluation and records.

Each round: ``strategy.configure_train`` (rate, mask seed, client sampling, downlinks),
``grid.send_and_receive`` with the round timeout, ``strategy.aggregate_train`` (validation,
norm bounds and aggregation), centralized evaluation of the new global model on the held-out
test set, and one ``RoundLog`` line plus a checkpoint (``RunRecorder``).

``resume=true`` continues a killed run from its checkpoint (``server/checkpoint.py``): the
checkpoint's model, client-sampling state and failure count, the records of the rounds it
covers, and every later round as the uninterrupted run would have played it.

A round that accepts no update leaves the model unchanged and is recorded as failed
(``RoundLog.failed``, ``failure``). When ``max-failed-rounds`` rounds in a row fail, the
strategy raises ``FederationFailed``: the loop records that round and re-raises without
writing ``summary.json``, so the ServerApp ends with an error naming the reasons (Flower marks
the run failed; the simulation engine exits with code 700) and the launchers, which read
``summary.json``, report the run as failed with the log's tail.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from logging import ERROR, INFO
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common.logger import log
from flwr.serverapp import Grid

from fedsparse.common.config import FederatedConfig
from fedsparse.common.data.datasets import Split, load_eval_splits
from fedsparse.common.layout import ParamLayout
from fedsparse.common.methods import public_split
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.training.centralized import pretrain_public
from fedsparse.common.training.local import evaluate
from fedsparse.common.wire.run_log import FAILURE_FILE, RoundLog, RunSummary, one_line, untrained
from fedsparse.server.checkpoint import (
    CHECKPOINT,
    Checkpoint,
    CheckpointError,
    load_checkpoint,
)
from fedsparse.server.launch_markers import EXPECTED_NODES_ENV
from fedsparse.server.round_stats import FederationFailed, RoundStats
from fedsparse.server.run_records import RunRecorder
from fedsparse.server.secagg_round import secure_round
from fedsparse.server.strategy import SparseFedAvg, flat_array, flat_tensor

__all__ = ["expected_nodes", "run_federated", "take_runners", "wait_for_nodes"]


def wait_for_nodes(grid: Grid, minimum: int, timeout: float, *, expected: int = 0) -> list[int]:
    """The connected node ids once at least ``minimum`` (and ``expected``) are connected.

    Args:
        expected: the number of nodes the launcher started (0: unknown). A simulation
            registers its nodes while the ServerApp starts (Flower's ``run_simulation`` starts
            the ServerApp thread before ``start_vce`` registers them), so round 1 could
            otherwise sample from the first ``minimum`` registered: fewer clients, and a
            model that depends on thread timing.

    Raises:
        TimeoutError: fewer than ``max(minimum, expected)`` nodes after ``timeout`` seconds.
    """
    wanted = max(minimum, expected)
    deadline = time.monotonic() + timeout
    first = True
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= wanted:
            return nodes
        if first:
            log(INFO, "fedsparse: waiting for %d nodes (%d connected)", wanted, len(nodes))
            first = False
        if time.monotonic() > deadline:
            what = f"min-clients={minimum}" if wanted == minimum else f"{wanted} expected nodes"
            raise TimeoutError(f"{what}: only {len(nodes)} nodes connected after {timeout:.0f} s")
        time.sleep(0.05 if expected else 1.0)


def expected_nodes(environ: Mapping[str, str]) -> int:
    """``$FEDSPARSE_EXPECTED_NODES``: how many nodes a launcher started (0 when unset).

    Raises:
        ValueError: not an integer >= 0 (the variable and value are named).
    """
    text = environ.get(EXPECTED_NODES_ENV, "").strip()
    if not text:
        return 0
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{EXPECTED_NODES_ENV}={text!r}: expected an integer >= 0")
    return value


def run_federated(grid: Grid, cfg: FederatedConfig, *, expected_nodes: int = 0) -> RunSummary:
    """Runs every round; returns the run summary (also written to ``summary.json``).

    With ``resume=true`` it continues the run in ``out-dir`` after the round of its
    ``checkpoint.pt`` (``server/checkpoint.py``): with the same seeds and clients that keep
    their state (``client/state.py``) it ends with the model the uninterrupted run ends with.

    ``expected_nodes`` (0: unknown) is how many nodes the launcher started: round 1 waits for
    all of them (``wait_for_nodes``), not only for ``min-clients``.

    Raises:
        CheckpointError: ``resume=true`` and no usable checkpoint (nothing is touched).
        FederationFailed: ``max-failed-rounds`` failed rounds in a row.
    """
    torch.set_num_threads(1)
    model = build_model(cfg.model_name, seed=cfg.seed)
    layout = ParamLayout.from_module(model)
    d = layout.numel
    train, test = load_eval_splits(
        cfg.dataset,
        data_dir=cfg.data_dir or None,
        seed=cfg.seed,
        eval_split=cfg.eval_split,
        split_seed=cfg.data_seed,
    )
    # The coordinates the method may freeze (lf: the first freeze-layers layers'; a bad count
    # fails here, first), checked by the strategy's own instance of the method.
    frozen = cfg.make_method().frozen_prefix(layout)
    # The most examples a client can hold (dp-norm-bound): the whole training split, since a
    # deployed node may declare all of it, also when this run holds out a validation slice.
    full_train = len(train) + (len(test) if cfg.eval_split == "validation" else 0)
    strategy = SparseFedAvg(
        cfg, num_parameters=d, frozen_prefix=frozen, layout=layout, train_examples=full_train
    )
    out = Path(cfg.out_dir or "runs/latest")
    # Nothing in out-dir is touched before the nodes are there (recorder.begin): a start that
    # fails (a bad checkpoint, too few nodes) leaves the previous records as they were.
    checkpoint = _resume(out, cfg, layout, strategy) if cfg.resume else None
    done = checkpoint.round if checkpoint is not None else 0
    recorder = RunRecorder(out, cfg, layout, resume_from=done, strategy_state=strategy.state_dict)
    if checkpoint is None and strategy.method.pretrains_on_public:
        _pretrain_on_public(model, train, cfg)
    weights = checkpoint.weights if checkpoint is not None else layout.flatten_module(model)
    arrays = flat_array(weights)
    log(
        INFO,
        "fedsparse: %s, model %s (d=%d), %d rounds%s",
        cfg.dataset,
        cfg.model_name,
        d,
        cfg.num_rounds,
        f", resumed after round {done}" if checkpoint is not None else "",
    )
    strategy.summary()
    nodes = wait_for_nodes(grid, cfg.min_clients, cfg.round_timeout, expected=expected_nodes)
    if checkpoint is not None:
        strategy.drop_absent_nodes(nodes)
    recorder.begin()
    for server_round in range(done + 1, cfg.num_rounds + 1):
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
        failed: FederationFailed | None = None
        new_arrays: ArrayRecord | None
        try:
            if cfg.secure_aggregation:  # the server decodes the sum only (secagg_round.py)
                new_arrays = secure_round(
                    strategy, grid, server_round, messages, timeout=cfg.round_timeout
                )
            else:
                replies = drained(grid.send_and_receive(messages, timeout=cfg.round_timeout))
                new_arrays, _ = strategy.aggregate_train(server_round, replies)
        except FederationFailed as err:  # the model is unchanged; record the round first
            failed, new_arrays = err, None
        arrays = new_arrays if new_arrays is not None else arrays
        stats = strategy.last_round
        assert stats is not None
        weights = flat_tensor(arrays)
        layout.load_flat_(model, weights)
        test_loss, test_acc = evaluate(model, test.x, test.y)
        entry = _round_log(
            stats, d=d, test_accuracy=test_acc, test_loss=test_loss, runners=take_runners(grid)
        )
        recorder.round_done(entry, weights)
        log(
            INFO,
            "round %d: r=%.3f acc=%.4f eps_max=%.3f up=%d B (dense %d B) rejected=%d missing=%d%s",
            server_round,
            stats.rate,
            test_acc,
            entry.epsilon_max,
            entry.uplink_payload_bytes,
            entry.dense_uplink_bytes,
            entry.num_rejected,
            entry.num_missing,
            " FAILED" if entry.failed else "",
        )
        if cfg.save_updates:
            recorder.save_updates(server_round, stats.updates)
        if failed is not None:
            raise _failed(out, str(failed))
    summary = recorder.finish()
    cause = untrained(recorder.logs)
    if cause is not None:  # the records are written; the run did not succeed
        raise _failed(out, cause)
    return summary


def take_runners(grid: Grid) -> dict[str, int] | None:
    """What trained the round's answered train messages, ``{runner: count}``, from a grid
    that counts them (this project's in-process, population and Ray grids:
    ``LocalGrid.take_runners``); None from one that does not (Flower's own)."""
    take = getattr(grid, "take_runners", None)
    return take() if callable(take) else None


def drained(replies: Iterable[Message]) -> Iterator[Message]:
    """``replies`` one at a time, each let go of when the next is taken: the round's messages
    are not all held while their updates are decoded (N dense updates would be held twice,
    as received and as decoded: 1.5 GB more at N = 10,000 of a 38k-parameter model). The
    caller keeps no reference (``del`` after passing it, or pass the call's result). A grid
    that streams its replies (``RayGrid``'s generator) is read as it streams: not gathered
    first, so the server decodes each while later ones train."""
    if not isinstance(replies, list):  # a stream: one at a time already
        yield from replies
        return
    queue = deque(replies)
    del replies
    while queue:
        yield queue.popleft()


def _failed(out: Path, cause: str) -> FederationFailed:
    """``FederationFailed`` with ``cause`` on one line, also written to ``FAILURE_FILE`` in
    ``out`` (what a launcher reports when the ServerApp ran in another process)."""
    line = one_line(cause)
    (out / FAILURE_FILE).write_text(line + "\n")
    log(ERROR, "fedsparse: %s", line)
    return FederationFailed(line)


def _pretrain_on_public(model: torch.nn.Module, train: Split, cfg: FederatedConfig) -> None:
    """DP-SSGD: the server pretrains the initial model on the public slice (no privacy spent)."""
    public, _ = public_split(len(train), cfg.public_fraction, run_seed=cfg.seed)
    index = torch.from_numpy(public)
    pretrain_public(
        model,
        train.x[index],
        train.y[index],
        epochs=cfg.public_epochs,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        seed=cfg.seed,
    )
    log(
        INFO,
        "fedsparse: dpssgd: pretrained %d epochs on %d public examples (of %d)",
        cfg.public_epochs,
        len(public),
        len(train),
    )


def _resume(
    out: Path, cfg: FederatedConfig, layout: ParamLayout, strategy: SparseFedAvg
) -> Checkpoint:
    """The checkpoint in ``out``, checked, with the strategy's state restored from it.

    Raises:
        CheckpointError: no usable checkpoint (``load_checkpoint``) or strategy state.
    """
    path = out / CHECKPOINT
    checkpoint = load_checkpoint(path, cfg=cfg, layout=layout)
    try:
        strategy.load_state_dict(checkpoint.strategy, resumed_from=checkpoint.round)
    except ValueError as err:
        raise CheckpointError(f"checkpoint {path}: {err}") from None
    return checkpoint


def _round_log(
    stats: RoundStats,
    *,
    d: int,
    test_accuracy: float,
    test_loss: float,
    runners: dict[str, int] | None,
) -> RoundLog:
    """The round's ``rounds.jsonl`` line."""
    return RoundLog(
        round=stats.server_round,
        num_clients=len(stats.selected),
        num_replies=stats.num_replies,
        num_rejected=len(stats.rejected),
        rate=stats.rate,
        keep=stats.keep,
        keep_fraction=stats.keep / d,
        test_accuracy=test_accuracy,
        test_loss=test_loss,
        epsilon_max=stats.epsilon_max,
        epsilon_median=stats.epsilon_median,
        train_loss=stats.train_loss,
        uplink_payload_bytes=stats.uplink_payload_bytes,
        uplink_message_bytes=stats.uplink_message_bytes,
        downlink_payload_bytes=stats.downlink_payload_bytes,
        downlink_message_bytes=stats.downlink_message_bytes,
        dense_uplink_bytes=stats.answered * d * 4,
        dense_downlink_bytes=len(stats.selected) * d * 4,
        wall_seconds=time.perf_counter() - stats.started,
        started_at=stats.started_at,
        ended_at=time.time(),
        rejected=stats.rejected,
        num_missing=stats.missing,
        num_accepted=stats.accepted,
        failed=stats.failed,
        failure=stats.failure,
        noise=stats.noise,
        clipped=stats.clipped,
        user_epsilon=stats.user_epsilon,
        noise_multiplier_min=stats.noise_multiplier_min,
        noise_multiplier_max=stats.noise_multiplier_max,
        central_epsilon=stats.central_epsilon,
        central_noise_multiplier=stats.central_noise_multiplier,
        secagg_bytes=stats.secagg_bytes,
        runners=runners,
    )
