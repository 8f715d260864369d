"""fedsparse ClientApp: local DP-SGD + RS on a partition, values-only sparse uplink.

Per ``train`` message the client (1) parses the ``TrainInstruction`` and patches its stored
copy of the global model with the downlink payload (dense on first participation, else the
values it is missing), (2) regenerates the round's public mask from the broadcast seed
(``mask-scope=round``) or from the seed and its node id (``mask-scope=client``), (3) runs
``local-epochs`` of DP-SGD + RS with a fresh optimizer and the Opacus accountant restored
from ``Context.state``, and (4) replies with a ``TrainReply``: the model delta on kept
coordinates as one ``SparseUpdate`` with no indices.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedsparse.client.data import local_data
from fedsparse.client.state import NodeState, apply_downlink
from fedsparse.common.config import FederatedConfig, wire_encoding
from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import sample_mask
from fedsparse.common.models import build_model
from fedsparse.common.payload import decode_update, encode_update
from fedsparse.common.privacy import calibrate_noise_multiplier, sample_rate, steps_per_epoch
from fedsparse.common.protocol import (
    CONFIG_RECORD,
    METRICS_RECORD,
    EvaluateInstruction,
    EvaluateReply,
    TrainInstruction,
    TrainReply,
    client_mask_seed,
)
from fedsparse.common.seeds import client_train_seed
from fedsparse.common.training import (
    PrivacyConfig,
    TrainConfig,
    evaluate,
    make_private,
    train_one_epoch,
)

__all__ = ["app"]

#: Opacus warnings that say nothing to an operator of this app.
_QUIET = ("Secure RNG turned off", "Optimal order is the largest alpha", "Full backward hook")

app = ClientApp()


def _node_partition(context: Context) -> tuple[int, int]:
    return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])


def _calibrated(privacy: PrivacyConfig, cfg: FederatedConfig, num_examples: int) -> PrivacyConfig:
    """``privacy`` with sigma calibrated for the whole run's steps, if it has a target epsilon.

    Calibrated once for the worst case: this client trains in every round.
    """
    if privacy.target_epsilon is None:
        return privacy
    steps = cfg.num_rounds * cfg.local_epochs * steps_per_epoch(num_examples, cfg.batch_size)
    sigma = calibrate_noise_multiplier(
        target_epsilon=privacy.target_epsilon,
        delta=privacy.delta,
        sample_rate=sample_rate(num_examples, cfg.batch_size),
        steps=steps,
        accountant=privacy.accountant,
    )
    return dataclasses.replace(privacy, noise_multiplier=sigma, target_epsilon=None)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local DP-SGD + RS; replies with a values-only sparse update."""
    torch.set_num_threads(1)
    cfg = FederatedConfig.from_run_config(context.run_config)
    task = TrainInstruction.from_record(msg.content.config_records[CONFIG_RECORD])
    data = local_data(cfg, *_node_partition(context))

    model = build_model(cfg.model_name, seed=cfg.seed)
    layout = ParamLayout.from_module(model)
    numel = layout.numel
    state = NodeState.load(context, numel)
    global_flat = apply_downlink(
        state.model,
        state.version,
        task.model,
        base_version=task.base_version,
        numel=numel,
        server_round=task.server_round,
    )
    layout.load_flat_(model, global_flat)

    # The round's public mask: from the broadcast seed (and node id for per-client masks).
    mask_seed = task.mask_seed
    if task.mask_scope == "client":
        mask_seed = client_mask_seed(mask_seed, context.node_id)
    mask = None if task.keep == numel else sample_mask(numel, keep=task.keep, seed=mask_seed)

    train_cfg = TrainConfig(
        epochs=task.local_epochs,
        batch_size=task.batch_size,
        lr=task.lr,
        momentum=task.momentum,
        seed=client_train_seed(cfg.seed, task.server_round, _node_partition(context)[0]),
    )
    with warnings.catch_warnings():
        for text in _QUIET:
            warnings.filterwarnings("ignore", message=text)
        privacy = _calibrated(cfg.privacy(), cfg, len(data))
        engine, module, optimizer, loader = make_private(
            model, data.x, data.y, privacy=privacy, train=train_cfg, epochs_for_target=1
        )
        engine.accountant.history = list(state.history)
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
        round=task.server_round,
        mask_seed=None if mask is None else mask_seed,
        encoding=wire_encoding(cfg.codec, sparse=mask is not None),
        value_dtype=cfg.value_dtype,
        compression=cfg.compression,
    )
    NodeState(global_flat, task.model_version, list(engine.accountant.history)).save(context)
    reply = TrainReply(
        update=payload,
        num_examples=len(data),
        examples_seen=examples,
        train_loss=float(np.nanmean(losses)) if examples else 0.0,
        epsilon=float(epsilon),
        noise_multiplier=float(privacy.noise_multiplier or 0.0),
        keep=int(values.numel()),
    )
    config, metrics = reply.to_records()
    content = RecordDict(
        {CONFIG_RECORD: ConfigRecord(config), METRICS_RECORD: MetricRecord(metrics)}
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_global(msg: Message, context: Context) -> Message:
    """Evaluates the dense global model in the message on this node's partition."""
    torch.set_num_threads(1)
    cfg = FederatedConfig.from_run_config(context.run_config)
    task = EvaluateInstruction.from_record(msg.content.config_records[CONFIG_RECORD])
    data = local_data(cfg, *_node_partition(context))
    model = build_model(cfg.model_name, seed=cfg.seed)
    layout = ParamLayout.from_module(model)
    update = decode_update(task.model, expected_dense_size=layout.numel)
    layout.load_flat_(model, update.to_dense())
    loss, accuracy = evaluate(model, data.x, data.y)
    reply = EvaluateReply(num_examples=len(data), loss=loss, accuracy=accuracy)
    return Message(
        content=RecordDict({METRICS_RECORD: MetricRecord(reply.to_record())}), reply_to=msg
    )
