"""Stock ClientApp: the dense global model in, plain Opacus DP-SGD, the dense model out.

The message layout is the one Flower's ``FedAvg`` sends and expects: an ``ArrayRecord``
``"arrays"`` (the model's ``state_dict``) and a ``ConfigRecord`` ``"config"`` (with
``server-round``); the reply carries the trained ``state_dict`` and a ``MetricRecord`` whose
``num-examples`` weights the average.
"""

from __future__ import annotations

from typing import cast

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from stock_opacus.task import StockConfig, build_net, load_partition, train_dp

__all__ = ["app"]

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local DP-SGD from the received model; replies with the new model."""
    torch.set_num_threads(1)  # simulated clients share the machine's cores (as fedsparse's)
    cfg = StockConfig.from_run_config(context.run_config)
    partition_id = int(context.node_config["partition-id"])
    data = load_partition(cfg, partition_id, int(context.node_config["num-partitions"]))
    net = build_net(cfg)
    net.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    server_round = int(cast(int, msg.content.config_records["config"]["server-round"]))
    result = train_dp(net, data, cfg=cfg, server_round=server_round, partition_id=partition_id)
    metrics = MetricRecord(
        {
            "num-examples": len(data),
            "examples-seen": result.examples,
            "num-steps": result.steps,
            "train-loss": result.loss,
            "epsilon": result.epsilon,
        }
    )
    content = RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)
