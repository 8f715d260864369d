"""RayGrid: many virtual clients per Ray worker, the same results as Flower's simulation.

The Ray tests share one local cluster (4 logical CPUs and 1 logical GPU, so that fractional
GPUs can be scheduled on a machine without one) and one pool of 2 workers; each test assigns
the pool its own clients, as a sweep's runs do.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from flwr.app import Context, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from typer.testing import CliRunner

from fedsparse.client.app import app as client_app
from fedsparse.client.node_policy import SIMULATION_NODE_POLICY
from fedsparse.common.config import FederatedConfig
from fedsparse.common.wire.run_log import read_rounds
from fedsparse.lab.cli import app as cli_app
from fedsparse.lab.launch.run_dir import INPUTS_FILE, RunFolderError, RunInputs, check_inputs
from fedsparse.lab.launch.simulate import run_simulation
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.lab.simulation.population import PopulationGrid
from fedsparse.lab.simulation.raygrid import RayGrid
from fedsparse.lab.simulation.rayworkers import (
    RayWorkers,
    VirtualClients,
    ray_cluster,
    worker_count,
)
from fedsparse.server.app import run_federated

D_DIGITS = 38_282
QUICK = {"dataset": "digits", "min-clients": "2"}
#: Fields of a round's record that are times, not results.
TIMES = ("wall_seconds", "started_at", "ended_at")
#: Fields whose Flower framing holds the node and message ids (random in Flower's simulation).
FRAMING = ("uplink_message_bytes", "downlink_message_bytes")


def _echo_app(msg: Message, context: Context) -> Message:
    """A ClientApp other than fedsparse's (module level: Ray pickles it)."""
    return Message(msg.content, reply_to=msg)


def _faults() -> ModuleType:
    """``tests/lab/test_faults.py``, for its ``/proc`` scans (by path: under
    ``--import-mode=importlib`` the ``tests`` folder is not on ``sys.path``)."""
    path = Path(__file__).parents[1] / "lab" / "test_faults.py"
    spec = importlib.util.spec_from_file_location("fedsparse_test_faults", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _records(out: Path, *, drop: tuple[str, ...] = TIMES) -> list[str]:
    """Each round's record as canonical JSON (floats exact), without the ``drop`` fields."""
    rows = []
    for entry in read_rounds(out / "rounds.jsonl"):
        row = {k: v for k, v in dataclasses.asdict(entry).items() if k not in drop}
        rows.append(json.dumps(row, sort_keys=True))
    return rows


def _weights(out: Path) -> torch.Tensor:
    return torch.load(out / "checkpoint.pt", weights_only=False)["weights"]


def _config(out: Path, **overrides: str) -> FederatedConfig:
    return FederatedConfig.from_run_config({**QUICK, **overrides, "out-dir": str(out)})


@pytest.fixture(scope="module")
def workers() -> Iterator[RayWorkers]:
    with ray_cluster(num_cpus=4, num_gpus=1), RayWorkers(client_app, num_workers=2) as pool:
        yield pool


# -- without Ray ---------------------------------------------------------------------------------


def test_worker_count_fits_cpus_and_gpu_shares() -> None:
    assert worker_count(cpus=2, gpus=0, cpus_per_client=1, gpus_per_client=0) == 2
    assert worker_count(cpus=8, gpus=1, cpus_per_client=1, gpus_per_client=0.25) == 4
    assert worker_count(cpus=0.3, gpus=0, cpus_per_client=0.1, gpus_per_client=0) == 3
    assert worker_count(cpus=8, gpus=2, cpus_per_client=2, gpus_per_client=0.25) == 4
    with pytest.raises(ValueError, match="gpus_per_client=0.5: the Ray cluster has 0 free GPUs"):
        worker_count(cpus=2, gpus=0, cpus_per_client=1, gpus_per_client=0.5)
    with pytest.raises(ValueError, match="cpus_per_client=4: the Ray cluster has 2 free CPUs"):
        worker_count(cpus=2, gpus=0, cpus_per_client=4, gpus_per_client=0)
    with pytest.raises(ValueError, match="gpus_per_client=-1"):
        worker_count(cpus=2, gpus=0, cpus_per_client=1, gpus_per_client=-1)


def test_virtual_clients_keep_one_context_each_and_turn_exceptions_into_error_replies() -> None:
    seen: list[tuple[int, int, int]] = []

    def echo(msg: Message, context: Context) -> Message:
        seen.append((context.run_id, context.node_id, int(context.node_config["partition-id"])))
        return Message(msg.content, reply_to=msg)

    def boom(msg: Message, context: Context) -> Message:
        raise RuntimeError(f"boom at node {context.node_id}")

    clients = VirtualClients(echo)
    clients.assign(
        run_id=7,
        nodes=[(11, 0), (12, 1), (13, 2)],
        num_partitions=3,
        node_config=SIMULATION_NODE_POLICY,
        run_config={"num-rounds": 1},
        overrides={12: boom},
    )
    InProcessGrid(echo, num_nodes=1, run_config={})  # sets this process's Flower task identity
    batch = [
        Message(content=RecordDict(), dst_node_id=n, message_type=MessageType.TRAIN, group_id="1")
        for n in (13, 12, 11)
    ]
    replies = clients.handle(batch)
    assert seen == [(7, 13, 2), (7, 11, 0)]
    assert [r.metadata.src_node_id for r in replies] == [13, 12, 11]
    assert not replies[0].has_error() and not replies[2].has_error()
    assert replies[1].error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert replies[1].error.reason == "RuntimeError: boom at node 12"
    stats = clients.stats()
    assert (stats.clients, stats.calls, stats.messages) == (3, 1, 3)


# -- on Ray ----------------------------------------------------------------------------------------


def test_same_records_and_model_as_in_process_with_client_sampling(
    workers: RayWorkers, tmp_path: Path
) -> None:
    # Same node ids on both grids, so the same clients are sampled: 3 of 5 a round, and
    # nodes that missed a round get a dense downlink, the others a sparse patch.
    sets = {"num-rounds": "3", "clients-per-round": "3", "final-rate": "0.5", "seed": "2"}
    cfg = _config(tmp_path / "ray", **sets)
    run_federated(RayGrid(workers, num_nodes=5, run_config=cfg.to_run_config()), cfg)
    ref = _config(tmp_path / "inproc", **sets)
    run_federated(InProcessGrid(client_app, num_nodes=5, run_config=ref.to_run_config()), ref)
    assert torch.equal(_weights(tmp_path / "ray"), _weights(tmp_path / "inproc"))
    ray_rounds, local = _records(tmp_path / "ray"), _records(tmp_path / "inproc")
    assert len(ray_rounds) == 3 and ray_rounds == local  # bytes of the messages included
    assert {r.num_clients for r in read_rounds(tmp_path / "ray" / "rounds.jsonl")} == {3}


def test_one_remote_call_per_worker_per_round_and_a_client_holds_only_its_state(
    workers: RayWorkers, tmp_path: Path
) -> None:
    cfg = _config(tmp_path, **{"num-rounds": "2", "final-rate": "0.5"})
    run_federated(RayGrid(workers, num_nodes=6, run_config=cfg.to_run_config()), cfg)
    stats = workers.stats()
    assert [(s.clients, s.calls, s.messages) for s in stats] == [(3, 2, 6), (3, 2, 6)]
    assert len({s.pid for s in stats}) == 2
    for s in stats:  # the model copy (fp32) and the accountant history, nothing else
        per_client = s.state_bytes / s.clients
        assert 4 * D_DIGITS < per_client < 4 * D_DIGITS + 4096, per_client
        assert s.context_bytes / s.clients < per_client + 8192  # + node and run config


def test_calls_of_chunk_size_messages_stream_their_replies_and_change_no_record(
    workers: RayWorkers, tmp_path: Path
) -> None:
    # 7 nodes on 2 workers (4 and 3), calls of at most 2 messages: 2 calls on each a round.
    sets = {"num-rounds": "2", "final-rate": "0.5"}
    cfg = _config(tmp_path / "chunked", **sets)
    grid = RayGrid(workers, num_nodes=7, run_config=cfg.to_run_config(), chunk_size=2)
    run_federated(grid, cfg)
    assert [(s.clients, s.calls, s.messages) for s in workers.stats()] == [(4, 4, 8), (3, 4, 6)]
    whole = _config(tmp_path / "whole", **sets)
    run_federated(RayGrid(workers, num_nodes=7, run_config=whole.to_run_config()), whole)
    assert [s.calls for s in workers.stats()] == [2, 2]
    assert torch.equal(_weights(tmp_path / "chunked"), _weights(tmp_path / "whole"))
    assert _records(tmp_path / "chunked") == _records(tmp_path / "whole")
    # The messages leave at once; the replies come as the caller iterates, and all of them.
    echo = RayGrid(workers, num_nodes=3, run_config={"num-rounds": 1}, chunk_size=1)
    msgs = [
        Message(content=RecordDict(), dst_node_id=n, message_type=MessageType.QUERY, group_id="1")
        for n in echo.get_node_ids()
    ]
    stream = echo.send_and_receive(msgs, timeout=60)
    assert not isinstance(stream, list)
    assert sorted(s.calls for s in workers.stats()) == [1, 2]  # sent before any iteration
    replies = list(stream)
    assert sorted(r.metadata.src_node_id for r in replies) == [1001, 1002, 1003]
    with pytest.raises(ValueError, match="chunk_size=0"):
        RayGrid(workers, num_nodes=2, run_config={}, chunk_size=0)


def test_a_raising_client_gets_an_error_reply_and_the_rounds_go_on(
    workers: RayWorkers, tmp_path: Path
) -> None:
    def boom(msg: Message, context: Context) -> Message:  # nested: pickled by value
        raise RuntimeError("boom")

    cfg = _config(tmp_path, **{"num-rounds": "2"})
    grid = RayGrid(workers, num_nodes=3, run_config=cfg.to_run_config(), overrides={1002: boom})
    summary = run_federated(grid, cfg)
    rounds = read_rounds(tmp_path / "rounds.jsonl")
    assert summary.rounds == 2 and [r.round for r in rounds] == [1, 2]
    for r in rounds:
        assert (r.num_clients, r.num_replies, r.num_accepted, r.failed) == (3, 3, 2, False)
        assert r.rejected == ["node 1002: client error: RuntimeError: boom"]


def test_a_dead_worker_costs_its_clients_not_the_run(workers: RayWorkers, tmp_path: Path) -> None:
    def die(msg: Message, context: Context) -> Message:
        os._exit(1)  # the worker process ends, with every client it holds

    cfg = _config(tmp_path, **{"num-rounds": "2"})
    # Round robin: worker 0 holds 1001 and 1003, worker 1 holds 1002 and 1004.
    grid = RayGrid(workers, num_nodes=4, run_config=cfg.to_run_config(), overrides={1002: die})
    run_federated(grid, cfg)
    first, second = read_rounds(tmp_path / "rounds.jsonl")
    assert (first.num_clients, first.num_accepted, first.num_missing) == (4, 2, 2)
    assert (second.num_clients, second.num_accepted, second.num_missing) == (2, 2, 0)
    assert sorted(grid.get_node_ids()) == [1001, 1003]
    # The next run on these workers gets a fresh worker in place of the dead one.
    cfg = _config(tmp_path / "next", **{"num-rounds": "1"})
    run_federated(RayGrid(workers, num_nodes=2, run_config=cfg.to_run_config()), cfg)
    assert read_rounds(tmp_path / "next" / "rounds.jsonl")[0].num_accepted == 2


def test_a_worker_without_the_dataset_files_names_its_node(
    workers: RayWorkers, tmp_path: Path
) -> None:
    # The files are checked where each worker runs, before the clients are made.
    run_config = {"dataset": "mnist", "data-dir": str(tmp_path / "nowhere"), "num-rounds": 1}
    with pytest.raises(FileNotFoundError) as info:
        RayGrid(workers, num_nodes=2, run_config=run_config)
    text = str(info.value)
    assert text.startswith("Ray node ") and "host " in text, text
    assert "dataset 'mnist': expected files train-images-idx3-ubyte" in text, text
    assert str(tmp_path / "nowhere") in text and "on each node" in text, text
    assert "Traceback" not in text, text
    # The files found, the same check passes (empty files: only their presence is checked).
    (tmp_path / "nowhere").mkdir()
    for name in ("train-images", "train-labels", "t10k-images", "t10k-labels"):
        kind = "idx3" if "images" in name else "idx1"
        (tmp_path / "nowhere" / f"{name}-{kind}-ubyte").write_bytes(b"")
    RayGrid(workers, num_nodes=2, run_config=run_config)


def test_fractional_gpus_put_several_workers_on_one_gpu(workers: RayWorkers) -> None:
    # The module's cluster has 4 CPUs (2 taken by ``workers``) and 1 logical GPU.
    with RayWorkers(client_app, gpus_per_client=0.5) as shared:
        stats = shared.stats()
        assert len(stats) == 2 and [s.gpu_ids for s in stats] == [("0",), ("0",)]
    with pytest.raises(ValueError, match="gpus_per_client=2: the Ray cluster has 1 free GPUs"):
        RayWorkers(client_app, gpus_per_client=2)
    with pytest.raises(ValueError, match=r"num_workers=3: expected 1\.\.2"):
        RayWorkers(client_app, num_workers=3)


def test_vectorised_workers_train_together_as_the_population_grid_does(
    workers: RayWorkers, tmp_path: Path
) -> None:
    """``RayWorkers(vectorised=True)``: each worker answers its train messages in one batch
    (Ray hands it a copy of the app: the driver checks it is fedsparse's), to float32
    rounding of the ``population`` backend's run; another app is refused."""
    sets = {"num-rounds": "2", "final-rate": "0.5"}
    cfg = _config(tmp_path / "ray", **sets)
    with RayWorkers(client_app, num_workers=2, vectorised=True) as pool:
        run_federated(RayGrid(pool, num_nodes=4, run_config=cfg.to_run_config()), cfg)
        stats = pool.stats()
    assert [(s.messages, s.together) for s in stats] == [(4, 4), (4, 4)]
    ref = _config(tmp_path / "population", **sets)
    grid = PopulationGrid(client_app, num_nodes=4, run_config=ref.to_run_config())
    run_federated(grid, ref)
    ours, theirs = _weights(tmp_path / "ray"), _weights(tmp_path / "population")
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4 * float(theirs.abs().max()))
    rounds = read_rounds(tmp_path / "ray" / "rounds.jsonl")
    assert [(r.num_accepted, r.uplink_payload_bytes) for r in rounds] == [
        (r.num_accepted, r.uplink_payload_bytes)
        for r in read_rounds(tmp_path / "population" / "rounds.jsonl")
    ]
    with pytest.raises(ValueError, match="vectorised=True: only fedsparse's ClientApp"):
        RayWorkers(_echo_app, num_workers=1, vectorised=True)


@pytest.mark.slow
def test_the_ray_population_backend_runs_as_population_and_resumes_in_its_family(
    workers: RayWorkers, tmp_path: Path
) -> None:
    """``--backend ray-population``: ``RayWorkers(vectorised=True)`` behind the commands, to
    float32 rounding of ``population``'s run; a run may resume on the other's backend (one
    family), not on ``ray``'s."""
    sets = {**QUICK, "num-rounds": "2", "final-rate": "0.5", "clients-per-round": "0"}
    ours = run_simulation(
        out=tmp_path / "ray-population", overrides=sets, clients=4, backend="ray-population"
    )
    theirs = run_simulation(
        out=tmp_path / "population", overrides=sets, clients=4, backend="population"
    )
    a, b = _weights(tmp_path / "ray-population"), _weights(tmp_path / "population")
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4 * float(b.abs().max()))
    assert ours.epsilon_max == theirs.epsilon_max
    assert ours.final_test_accuracy == pytest.approx(theirs.final_test_accuracy, abs=0.02)
    saved = json.loads((tmp_path / "ray-population" / INPUTS_FILE).read_text())
    for backend in ("population", "ray"):
        inputs = dataclasses.replace(
            RunInputs(**saved),
            results=RunInputs.of_run(clients=4, backend=backend, data="", run_config={}).results,
        )
        if backend == "population":
            check_inputs(tmp_path / "ray-population", inputs)  # one family: it may resume
        else:
            with pytest.raises(RunFolderError, match="backend"):
                check_inputs(tmp_path / "ray-population", inputs)


@pytest.mark.slow
def test_bit_identical_to_flower_simulation_and_in_process(tmp_path: Path) -> None:
    # Full participation: Flower draws random node ids, so only then are the same clients
    # selected (node ids still travel in the message framing, whose size differs slightly).
    sets = {**QUICK, "num-rounds": "2", "final-rate": "0.5", "clients-per-round": "0"}
    flower = run_simulation(out=tmp_path / "flower", overrides=sets, clients=4)
    on_ray = run_simulation(out=tmp_path / "ray", overrides=sets, clients=4, backend="ray")
    ref = _config(tmp_path / "inproc", **sets)
    run_federated(InProcessGrid(client_app, num_nodes=4, run_config=ref.to_run_config()), ref)
    weights = _weights(tmp_path / "flower")
    assert torch.equal(weights, _weights(tmp_path / "ray"))
    assert torch.equal(weights, _weights(tmp_path / "inproc"))
    assert _records(tmp_path / "ray") == _records(tmp_path / "inproc")
    # Flower's engine does not say what trained a round (runners: null); ours count it
    results = _records(tmp_path / "ray", drop=TIMES + FRAMING + ("runners",))
    flower_records = _records(tmp_path / "flower", drop=TIMES + FRAMING + ("runners",))
    assert len(results) == 2 and results == flower_records
    assert [r.runners for r in read_rounds(tmp_path / "flower" / "rounds.jsonl")] == [None] * 2
    assert [r.runners for r in read_rounds(tmp_path / "ray" / "rounds.jsonl")] == [
        {"client-app": 4}
    ] * 2
    for a, b in zip(
        read_rounds(tmp_path / "flower" / "rounds.jsonl"),
        read_rounds(tmp_path / "ray" / "rounds.jsonl"),
        strict=True,
    ):
        for key in FRAMING:
            assert abs(getattr(a, key) - getattr(b, key)) < 0.01 * getattr(a, key), key
    assert flower.final_test_accuracy == on_ray.final_test_accuracy > 0.3
    assert flower.epsilon_max == on_ray.epsilon_max


# -- command line ----------------------------------------------------------------------------------


def test_cli_rejects_an_unknown_backend_and_parallel_ray_sweeps(tmp_path: Path) -> None:
    env = {"COLUMNS": "240"}
    args = ["simulate", "--out", str(tmp_path / "a"), "--backend", "dask"]
    result = CliRunner().invoke(cli_app, args, env=env)
    assert (
        result.exit_code != 0
        and "backend='dask': expected one of flower, inprocess, deploy, ray" in result.output
    )
    for backend in ("ray", "ray-population"):
        args = ["sweep", "--out", str(tmp_path / "b"), "--backend", backend, "--jobs", "2"]
        result = CliRunner().invoke(cli_app, args, env=env)
        assert result.exit_code != 0
        assert f"jobs=2: expected 1 with backend={backend!r}" in result.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _ray_processes(pids: list[int]) -> dict[str, set[int]]:
    """The GCS server and the ``VirtualClients`` workers among ``pids``."""
    found: dict[str, set[int]] = {"gcs": set(), "workers": set()}
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"gcs_server" in cmdline.split(b"\0")[0]:
            found["gcs"].add(pid)
        elif cmdline.startswith(b"ray::VirtualClients"):
            found["workers"].add(pid)
    return found


@pytest.mark.slow
def test_cli_sweep_runs_on_one_ray_cluster_and_leaves_no_process(tmp_path: Path) -> None:
    faults = _faults()
    out = tmp_path / "sweep"
    args = ["sweep", "--out", str(out), "--backend", "ray", "--clients", "3"]
    args += ["--grid", "final-rate=0.5,0.7", "--set", "num-rounds=1", "--set", "min-clients=2"]
    process, marker = faults._start(args, tmp_path / "cli.log")
    seen: dict[str, set[int]] = {"gcs": set(), "workers": set()}
    most = 0  # the most workers alive at once
    try:
        while process.poll() is None:
            now = _ray_processes(faults._marked(marker))
            for kind, pids in now.items():
                seen[kind] |= pids
            most = max(most, len(now["workers"]))
            time.sleep(0.2)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, (tmp_path / "cli.log").read_text()[-3000:]
    faults._assert_nothing_left(marker)
    # One cluster and one set of workers for both runs: no worker was ever replaced.
    assert len(seen["gcs"]) == 1
    assert 1 <= len(seen["workers"]) == most <= (os.cpu_count() or 1)
    rows = (out / "results.csv").read_text().splitlines()
    assert len(rows) == 3 and all(",ok," in row for row in rows[1:])
    for slug in ("final-rate-0.5_seed-0", "final-rate-0.7_seed-0"):
        assert json.loads((out / "runs" / slug / "sweep-run.json").read_text())["backend"] == "ray"
        assert len(read_rounds(out / "runs" / slug / "rounds.jsonl")) == 1


@pytest.mark.slow
def test_a_ray_simulation_stopped_by_sigterm_resumes_to_the_uninterrupted_model(
    tmp_path: Path,
) -> None:
    faults = _faults()
    # Rounds take ~0.25 s here: 12 of them leave the signal, sent once 2 are logged (0.5 s
    # polls), room to land before the last one (at 4 rounds it landed after it once).
    rounds = 12
    sets = ["--set", f"num-rounds={rounds}", "--set", "min-clients=2", "--set", "seed=3"]
    base = ["simulate", "--backend", "ray", "--clients", "3", *sets]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    # The uninterrupted run in process: the same records and model as on Ray, bit for bit
    # (test_same_records_and_model_as_in_process_with_client_sampling), without Ray's start-up.
    # It runs while Ray starts for the run to cut.
    whole_args = ["simulate", "--backend", "inprocess", "--clients", "3", *sets]
    uninterrupted, _ = faults._start([*whole_args, "--out", str(whole)], tmp_path / "whole.log")
    process, marker = faults._start([*base, "--out", str(cut)], tmp_path / "cut.log")
    try:
        faults._wait_rounds(cut / "rounds.jsonl", 2, process, timeout=300)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
    try:
        code = uninterrupted.wait(timeout=400)
        assert code == 0, (tmp_path / "whole.log").read_text()[-2000:]
    finally:
        if uninterrupted.poll() is None:
            uninterrupted.kill()
    faults._assert_nothing_left(marker)
    stopped_at = len(read_rounds(cut / "rounds.jsonl"))
    assert 2 <= stopped_at < rounds and not (cut / "summary.json").exists()
    args = [*base, "--out", str(cut), "--resume"]
    process, _ = faults._start(args, tmp_path / "resume.log")
    assert process.wait(timeout=400) == 0, (tmp_path / "resume.log").read_text()[-2000:]
    assert torch.equal(_weights(whole), _weights(cut))  # bit for bit
    # The resumed rounds' downlinks differ (dense to every node, ``resumed-from``): not these.
    rounds_whole, rounds_cut = (
        read_rounds(whole / "rounds.jsonl"),
        read_rounds(cut / "rounds.jsonl"),
    )
    for x, y in zip(rounds_whole, rounds_cut, strict=True):
        assert (x.round, x.test_accuracy, x.epsilon_max, x.uplink_payload_bytes) == (
            y.round,
            y.test_accuracy,
            y.epsilon_max,
            y.uplink_payload_bytes,
        )
    assert [r.round for r in rounds_cut] == list(range(1, rounds + 1))
