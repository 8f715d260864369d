"""Benchmark: K clients' rounds batched on one device against Opacus's per-client loop.

The same clients' rounds two ways:

* ``population``: ``population_round`` (``client/population.py``): the clients' weights
  stacked, each DP-SGD step's per-sample gradients of a whole chunk of clients in one
  ``vmap`` over clients of ``vmap(grad)`` over examples;
* ``opacus loop``: ``client_round`` for one client after another, each on Opacus
  (``engine="opacus"``): ``make_private``, hooks, its optimizer, the round's reply.

The work: one round of DP-SGD with random sparsification (RS at r = 0.9, σ = 1, C = 1, the
round's seeded mask), one local epoch of Poisson batches of expected size 32, FedAvg's
learning rate 0.05, every client the same model (``--models``):

* ``digits-cnn`` (38,282 weights) on digits' 1,437 training images cut into N iid shards;
* ``dpcnn`` (550,570 weights, CIFAR-10's 3 x 32 x 32 input) on ``--cifar-shard`` synthetic
  examples a client (normal images, uniform labels: CIFAR-10 cannot be downloaded, and the
  time of a step does not depend on the pixels).

The population round runs all N clients; the loop runs the first ``--loop-clients`` of them
(the loop's time is linear in clients) and its rate is per client. Each is timed ``--reps``
times after a warm-up round; the medians give clients a second and the ratio. The loop's
clients are also checked against the population's rounds: the largest difference of their
decoded updates relative to the update's largest value (on CUDA under ``exact_cudnn``-like
settings: TF32 off, deterministic cuDNN; see docs/gpu/README.md).

Usage: python benchmarks/population_gpu.py [--device cuda] [--models digits-cnn,dpcnn]
       [--clients 100,1000] [--loop-clients 32] [--reps 3] [--chunk-gib 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from fedsparse.client.data import local_data
from fedsparse.client.local_round import (
    PublicRound,
    Release,
    RoundNoise,
    RoundPrivacy,
    client_round,
)
from fedsparse.client.model_cache import process_model
from fedsparse.client.population import ClientCall, population_error, population_round
from fedsparse.common.config import FederatedConfig
from fedsparse.common.data.datasets import Split
from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import keep_count
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.wire.payload import decode_update, encode_update
from fedsparse.common.wire.protocol import TrainInstruction, round_seed

warnings.filterwarnings("ignore")

DATASETS = {"digits-cnn": "digits", "dpcnn": "cifar10"}


def run_config(model: str, device: str) -> FederatedConfig:
    return FederatedConfig(
        dataset=DATASETS[model],  # type: ignore[arg-type]
        model=model,  # type: ignore[arg-type]
        num_rounds=10,
        final_rate=0.9,
        schedule="constant",
        target_epsilon=0.0,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        batch_size=32,
        local_epochs=1,
        lr=0.05,
        momentum=0.0,
        seed=0,
        device=device,  # type: ignore[arg-type]
        engine="opacus",
    )


def shards(run: FederatedConfig, clients: int, cifar_shard: int) -> list[Split]:
    if run.dataset == "digits":
        return [local_data(run, p, clients) for p in range(clients)]
    gen = torch.Generator().manual_seed(1)
    return [
        Split(
            x=torch.randn(cifar_shard, 3, 32, 32, generator=gen),
            y=torch.randint(0, 10, (cifar_shard,), generator=gen),
        )
        for _ in range(clients)
    ]


def calls(run: FederatedConfig, data: list[Split]) -> list[ClientCall]:
    model = build_model(run.model_name, seed=run.seed)
    flat = ParamLayout.from_module(model).flatten_module(model)
    d = flat.numel()
    task = TrainInstruction(
        server_round=1,
        num_rounds=run.num_rounds,
        mask_seed=round_seed(run.seed, 1),
        keep=keep_count(d, rate=run.final_rate),
        mask_scope=run.mask_scope,
        local_epochs=run.local_epochs,
        batch_size=run.batch_size,
        lr=run.lr,
        momentum=run.momentum,
        base_version=-1,
        model_version=0,
        model=encode_update(flat, dense_size=d, round=1),
    )
    out = []
    for p, examples in enumerate(data):
        method = run.make_method()
        keep_fraction, _ = method.index_charge(
            task, d, None, 0, schedule=run.sparsity().rate_schedule(run.num_rounds)
        )
        out.append(
            ClientCall(
                global_flat=flat,
                examples=examples,
                public=PublicRound(cfg=run, task=task, method=method, node_id=1001 + p),
                privacy=RoundPrivacy(
                    privacy=run.privacy(),
                    history=[],
                    index_spent=0.0,
                    nominal_size=None,
                    keep_fraction=keep_fraction,
                ),
                noise=RoundNoise(seeded=True, run_seed=run.seed, partition_id=p),
                release=Release(example_count=True, train_loss=True),
            )
        )
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--models", default="digits-cnn,dpcnn")
    parser.add_argument("--clients", default="100,1000")
    parser.add_argument("--loop-clients", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunk-gib", type=float, default=4.0)
    parser.add_argument("--cifar-shard", type=int, default=50)
    args = parser.parse_args()
    if args.device == "cuda":
        # exact float32 convolutions on both sides (TF32 is cuDNN's default on Ampere+)
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        where = torch.cuda.get_device_name(0)
    else:
        where = f"cpu, {torch.get_num_threads()} threads"
    print(f"# population_gpu: {where}; torch {torch.__version__}; chunk {args.chunk_gib} GiB")
    chunk = int(args.chunk_gib * 2**30)
    for name in args.models.split(","):
        run = run_config(name, args.device)
        model = process_model(run.model_name, run.seed).model
        for n in (int(c) for c in args.clients.split(",")):
            work = calls(run, shards(run, n, args.cifar_shard))
            assert all(population_error(c, model) is None for c in work), population_error(
                work[0], model
            )
            loop = work[: args.loop_clients]

            def together(work=work, model=model):
                return population_round(work, model=model, chunk_bytes=chunk)

            def alone(loop=loop, model=model):
                return [
                    client_round(
                        c.global_flat,
                        c.examples,
                        c.public,
                        c.privacy,
                        c.noise,
                        model=model,
                        release=c.release,
                    )
                    for c in loop
                ]

            got, ref = together(), alone()  # warm-up, and the check
            worst = 0.0
            for a, b in zip(got, ref, strict=False):
                ours, theirs = decode_update(a.reply.update), decode_update(b.reply.update)
                scale = float(theirs.values.abs().max())
                worst = max(worst, float((ours.values - theirs.values).abs().max()) / scale)
            pop, per = [], []
            for _ in range(args.reps):
                pop.append(timed(together, args.device))
                per.append(timed(alone, args.device))
            pop_s, loop_s = statistics.median(pop), statistics.median(per)
            pop_rate = n / pop_s
            loop_rate = len(loop) / loop_s
            peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0
            print(
                f"model={name} clients={n} examples={sum(len(c.examples) for c in work)} "
                f"population={pop_s:.3f}s ({pop_rate:.0f} clients/s) "
                f"opacus-loop={loop_s:.3f}s/{len(loop)} ({loop_rate:.1f} clients/s) "
                f"speedup={pop_rate / loop_rate:.1f}x max-rel-diff={worst:.1e} "
                f"gpu-peak={peak:.2f}GiB reps={[round(t, 3) for t in pop]}",
                flush=True,
            )
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
