"""fedsparse ClientApp: local DP-SGD + RS on a partition, values-only sparse uplink.

Per ``train`` message the client (1) patches its stored copy of the global model with the
downlink payload (dense on first participation, else the values it is missing), (2)
regenerates the round's public mask from the broadcast seed (``mask-scope=round``) or from
the seed and its node id (``mask-scope=client``), (3) runs ``local-epochs`` of DP-SGD + RS
with a fresh optimizer, the Opacus accountant restored from ``Context.state``, and (4) sends
the model delta on kept coordinates as one ``SparseUpdate`` with no indices.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from opacus.accountants.utils import get_noise_multiplier

from fedsparse.common.config import FederatedConfig, wire_encoding
from fedsparse.common.data import Split, load_dataset
from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import derive_seed, sample_mask
from fedsparse.common.models import DEFAULT_MODELS, build_model
from fedsparse.common.partition import partition_indices
from fedsparse.common.payload import decode_update, encode_update
from fedsparse.common.protocol import (
    CONFIG_RECORD,
    METRICS_RECORD,
    STATE_MODEL,
    STATE_RECORD,
    client_mask_seed,
)
from fedsparse.common.training import TrainConfig, evaluate, make_private, train_one_epoch

for _message in (
    "Secure RNG turned off",
    "Optimal order is the largest alpha",
    "Full backward hook is firing",
):
    warnings.filterwarnings("ignore", message=_message)

app = ClientApp()


def model_name(cfg: FederatedConfig) -> str:
    """The model for ``cfg`` (``model`` key, else the dataset's default)."""
    return cfg.model or DEFAULT_MODELS[cfg.dataset]


@functools.lru_cache(maxsize=4)
def _dataset(name: str, data_dir: str, seed: int) -> tuple[Split, Split]:
    return load_dataset(name, data_dir=data_dir or None, seed=seed)


@functools.lru_cache(maxsize=4)
def _partitions(
    name: str, data_dir: str, seed: int, num_partitions: int, partitioner: str, alpha: float
) -> tuple[np.ndarray, ...]:
    train, _ = _dataset(name, data_dir, seed)
    return tuple(
        partition_indices(
            train.y.numpy(),
            num_partitions=num_partitions,
            partitioner=partitioner,
            alpha=alpha,
            seed=seed,
        )
    )


def local_data(cfg: FederatedConfig, partition_id: int, num_partitions: int) -> Split:
    """This node's training partition (cached per process; keyed by every input)."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition-id={partition_id}: expected 0 <= id < num-partitions={num_partitions}"
        )
    train, _ = _dataset(cfg.dataset, cfg.data_dir, cfg.seed)
    idx = torch.from_numpy(
        _partitions(
            cfg.dataset,
            cfg.data_dir,
            cfg.seed,
            num_partitions,
            cfg.partitioner,
            cfg.dirichlet_alpha,
        )[partition_id]
    )
    return Split(x=train.x[idx], y=train.y[idx])


def _load_state(context: Context, numel: int) -> tuple[torch.Tensor | None, int, list]:
    """(stored global model or None, its version, accountant history) from ``Context.state``."""
    if STATE_RECORD not in context.state.config_records:
        return None, -1, []
    rec = context.state.config_records[STATE_RECORD]
    entries = zip(rec["acc-sigma"], rec["acc-q"], rec["acc-steps"], strict=True)
    history = [(float(s), float(q), int(n)) for s, q, n in entries if int(n) > 0]
    flat = torch.from_numpy(context.state.array_records[STATE_MODEL]["flat"].numpy().copy())
    if flat.numel() != numel:
        return None, -1, history
    return flat, int(rec["version"]), history


def _save_state(context: Context, flat: torch.Tensor, version: int, history: list) -> None:
    # A leading (0, 0, 0) entry keeps the lists non-empty; zero-step entries are skipped on load.
    entries = [(0.0, 0.0, 0), *history]
    context.state.config_records[STATE_RECORD] = ConfigRecord(
        {
            "version": version,
            "acc-sigma": [float(h[0]) for h in entries],
            "acc-q": [float(h[1]) for h in entries],
            "acc-steps": [int(h[2]) for h in entries],
        }
    )
    context.state.array_records[STATE_MODEL] = ArrayRecord({"flat": Array(flat.numpy())})


def apply_downlink(
    stored: torch.Tensor | None,
    stored_version: int,
    payload: bytes,
    *,
    base_version: int,
    numel: int,
    server_round: int,
) -> torch.Tensor:
    """The global model after patching ``stored`` with the downlink ``payload`` (exact)."""
    update = decode_update(payload, expected_dense_size=numel, expected_round=server_round)
    if update.encoding == "dense":
        return update.values.clone()
    if stored is None or stored_version != base_version:
        raise ValueError(
            f"base-version={base_version}: this node holds model version {stored_version}; "
            "the server must send the dense model"
        )
    flat = stored.clone()
    support = update.support()
    flat[support] = update.values
    return flat


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local DP-SGD + RS; replies with a values-only sparse update."""
    torch.set_num_threads(1)
    cfg = FederatedConfig.from_run_config(context.run_config)
    conf = msg.content.config_records[CONFIG_RECORD]
    server_round = int(conf["round"])
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    data = local_data(cfg, partition_id, num_partitions)

    model = build_model(model_name(cfg), seed=cfg.seed)
    layout = ParamLayout.from_module(model)
    numel = layout.numel
    stored, stored_version, history = _load_state(context, numel)
    global_flat = apply_downlink(
        stored,
        stored_version,
        bytes(conf["model"]),
        base_version=int(conf["base-version"]),
        numel=numel,
        server_round=server_round,
    )
    model_version = int(conf["model-version"])
    layout.load_flat_(model, global_flat)

    # The round's public mask: from the broadcast seed (and node id for per-client masks).
    mask_seed = int(conf["mask-seed"])
    if conf["mask-scope"] == "client":
        mask_seed = client_mask_seed(mask_seed, context.node_id)
    keep = int(conf["keep"])
    mask = None if keep == numel else sample_mask(numel, keep=keep, seed=mask_seed)

    train_cfg = TrainConfig(
        epochs=int(conf["local-epochs"]),
        batch_size=int(conf["batch-size"]),
        lr=float(conf["lr"]),
        momentum=float(conf["momentum"]),
        seed=derive_seed(cfg.seed, server_round, partition_id),
    )
    privacy = cfg.privacy()
    if privacy.target_epsilon is not None:
        # Calibrated once for the worst case: this client trains in every round.
        q = 1.0 / -(-len(data) // min(train_cfg.batch_size, len(data)))
        sigma = get_noise_multiplier(
            target_epsilon=privacy.target_epsilon,
            target_delta=privacy.delta,
            sample_rate=q,
            epochs=cfg.num_rounds * cfg.local_epochs,
            accountant=privacy.accountant,
        )
        privacy = dataclasses.replace(privacy, noise_multiplier=sigma, target_epsilon=None)
    engine, module, optimizer, loader = make_private(
        model, data.x, data.y, privacy=privacy, train=train_cfg, epochs_for_target=1
    )
    engine.accountant.history = list(history)
    engine.set_mask(mask)
    losses, examples = [], 0
    for _ in range(train_cfg.epochs):
        loss, n = train_one_epoch(module, optimizer, loader)
        losses.append(loss)
        examples += n
    epsilon = engine.get_epsilon(privacy.delta)

    delta = layout.flatten_module(model) - global_flat
    values = delta if mask is None else delta[mask]
    payload = encode_update(
        values,
        dense_size=numel,
        round=server_round,
        mask_seed=None if mask is None else mask_seed,
        encoding=wire_encoding(cfg.codec, sparse=mask is not None),
        value_dtype=cfg.value_dtype,
        compression=cfg.compression,
    )
    _save_state(context, global_flat, model_version, list(engine.accountant.history))
    content = RecordDict(
        {
            CONFIG_RECORD: ConfigRecord({"update": payload}),
            METRICS_RECORD: MetricRecord(
                {
                    "num-examples": len(data),
                    "examples-seen": examples,
                    "train-loss": float(np.nanmean(losses)) if examples else 0.0,
                    "epsilon": float(epsilon) if np.isfinite(epsilon) else -1.0,
                    "noise-multiplier": float(privacy.noise_multiplier or 0.0),
                    "keep": int(values.numel()),
                }
            ),
        }
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_global(msg: Message, context: Context) -> Message:
    """Evaluates the dense global model in the message on this node's partition."""
    torch.set_num_threads(1)
    cfg = FederatedConfig.from_run_config(context.run_config)
    conf = msg.content.config_records[CONFIG_RECORD]
    data = local_data(
        cfg, int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    )
    model = build_model(model_name(cfg), seed=cfg.seed)
    layout = ParamLayout.from_module(model)
    update = decode_update(bytes(conf["model"]), expected_dense_size=layout.numel)
    layout.load_flat_(model, update.to_dense())
    loss, accuracy = evaluate(model, data.x, data.y)
    return Message(
        content=RecordDict(
            {
                METRICS_RECORD: MetricRecord(
                    {"num-examples": len(data), "loss": loss, "accuracy": accuracy}
                )
            }
        ),
        reply_to=msg,
    )
