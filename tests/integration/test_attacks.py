"""The reconstruction attack on real Flower runs: it works on a simulation, not on a deployment.

A curious server keeps every update (``save-updates``), rebuilds the seeded noise of each
partition from the run config alone (``lab/research/attacks.py``), and subtracts it. On the
simulation engine (seeded noise) what is left is the small noise-free update; on a loopback
deployment (SuperNodes with their default policy: fresh OS-entropy noise) it is a second
noise draw, larger than the update itself. (The replay attack and the node's refusal of a
repeated round are tested in process: ``tests/client/test_guard.py``.)
"""

from pathlib import Path

import pytest

from fedsparse.client.data import local_data
from fedsparse.common.config import FederatedConfig
from fedsparse.common.dp.accounting import sample_rate, steps_per_epoch
from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import keep_count, sample_mask
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.wire.payload import decode_update
from fedsparse.common.wire.protocol import round_seed
from fedsparse.common.wire.run_log import SEEDED_RUN
from fedsparse.lab.launch.deploy import run_deployment
from fedsparse.lab.launch.simulate import run_simulation
from fedsparse.lab.research.attacks import rebuild_seeded_noise

NODES = 2
OVERRIDES = {
    "num-rounds": 1,
    "final-rate": 0.5,
    "target-epsilon": 0.0,
    "noise-multiplier": 2.0,
    "lr": 1e-4,  # the noise-free part stays small next to the noise
    "save-updates": True,
}

pytestmark = pytest.mark.slow


def _best_residuals(out: Path) -> list[float]:
    """Per saved update: min over partitions of ||update - rebuilt noise|| / ||update||."""
    cfg = FederatedConfig.from_run_config({**OVERRIDES, "out-dir": str(out)})
    layout = ParamLayout.from_module(build_model(cfg.model_name, seed=cfg.seed))
    d = layout.numel
    mask = sample_mask(d, keep=keep_count(d, rate=0.5), seed=round_seed(cfg.seed, 1))
    files = sorted((out / "updates").glob("round-1-node-*.bin"))
    assert len(files) == NODES
    residuals = []
    for path in files:
        update = decode_update(path.read_bytes()).to_dense()
        best = float("inf")
        for partition in range(NODES):  # the server does not know which node holds which
            n = len(local_data(cfg, partition, NODES))
            noise = rebuild_seeded_noise(
                layout,
                run_seed=cfg.seed,
                server_round=1,
                partition_id=partition,
                steps=steps_per_epoch(n, cfg.batch_size),
                noise_multiplier=cfg.noise_multiplier,
                max_grad_norm=cfg.max_grad_norm,
                expected_batch_size=int(n * sample_rate(n, cfg.batch_size)),
                lr=cfg.lr,
                mask=mask,
            )
            best = min(best, float((update - noise).norm() / update.norm()))
        residuals.append(best)
    return residuals


def test_the_server_rebuilds_the_noise_of_simulated_clients(tmp_path: Path) -> None:
    summary = run_simulation(out=tmp_path, overrides=OVERRIDES, clients=NODES)
    assert summary.noise == SEEDED_RUN
    assert max(_best_residuals(tmp_path)) < 0.2


def test_the_server_cannot_rebuild_the_noise_of_deployed_clients(tmp_path: Path) -> None:
    summary = run_deployment(out=tmp_path, overrides=OVERRIDES, num_nodes=NODES, relay=False)
    assert summary.noise == "fresh"
    assert min(_best_residuals(tmp_path)) > 1.2  # ~sqrt(2): a second, independent draw
