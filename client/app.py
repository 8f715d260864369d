"""fedsparse ClientApp: local DP-SGD + RS on a partition, values-only sparse uplink.

Per ``train`` message the client (1) parses the ``TrainInstruction`` and patches its stored
copy of the global model with the downlink payload (dense on first participation, else the
values it is missing), (2) regenerates the round's public mask from the broadcast seed
(``mask-scope=round``) or from the seed and its node id (``mask-scope=client``), (3) runs
``local-epochs`` of DP-SGD + RS with a fresh optimizer and the Opacus accountant restored
from ``Context.state`` (restored from the node's ``state-dir`` when a simulated run resumes,
``client/state.py``), and (4) replies with a ``TrainReply``: the model delta on kept
coordinates as one ``SparseUpdate`` with no indices. Steps (2) to (4) are
``client/local_round.py``'s, on the process's reused model (``client/model_cache.py``); this
module checks the request, the node's policy and budget, and charges its ledger first.
"""

from __future__ import annotations

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedsparse.client.data import public_test_data, test_data
from fedsparse.client.guard import declaration, node_data, node_policy, released_error
from fedsparse.client.node_policy import PrivacyRefusal
from fedsparse.client.secagg_node import answer
from fedsparse.client.train_message import finish_train, prepare_train, run_alone, run_config
from fedsparse.common.layout import ParamLayout
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.training.local import evaluate
from fedsparse.common.wire.payload import decode_update
from fedsparse.common.wire.protocol import (
    CONFIG_RECORD,
    METRICS_RECORD,
    EvaluateInstruction,
    EvaluateReply,
    ProtocolError,
)
from fedsparse.common.wire.secagg import SECAGG_ACTION

__all__ = ["app"]

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local DP-SGD + RS; replies with a values-only sparse update.

    Order: everything the server's request alone decides is checked first (config, the
    instruction, the node's static policy limits, the downlink); then the node reads its
    data, refuses at once if its budget is spent, calibrates σ, charges the round to its
    ledger (``authorize``), trains and replies. Errors up to the ledger charge name only what
    the server sent or the node's own limits; a failure once training has started is the one
    fixed ``CLIENT_FAILURE`` (``released_error``).

    ``client/train_message.py``'s ``prepare_train``, ``run_alone`` (``client_round``) and
    ``finish_train``: a runner that trains many nodes at once (``train_population``) calls the
    first and the last per node around one ``population_round``.
    """
    prepared = prepare_train(msg, context)
    return finish_train(prepared, run_alone(prepared))


@app.query(SECAGG_ACTION)
def secure_aggregation(msg: Message, context: Context) -> Message:
    """A later stage of the round's secure sum (share keys, collect, unmask): ``answer``."""
    torch.set_num_threads(1)
    try:
        return answer(msg, context)
    except ProtocolError:
        raise  # the stage's refusal, naming the field
    except Exception as err:
        raise released_error(err, data_read=True) from None


@app.evaluate()
def evaluate_global(msg: Message, context: Context) -> Message:
    """Evaluates the dense global model in the message on public data, if the node allows it.

    Refused unless the node's policy says ``evaluate=true``; then on the public test split of
    the node's declared dataset (a simulated node without a declaration: the run's
    evaluation split), never on its training partition and never on files the server names:
    exact loss and accuracy of models the server chooses would release the data outside the
    accountant (10 bias-only models recover a label histogram).

    Raises:
        PrivacyRefusal: the policy does not allow it, or a deployed node declares no data.
        ProtocolError: the run names another dataset than the declared one.
    """
    torch.set_num_threads(1)
    policy = node_policy(context)
    cfg = run_config(context, policy)
    task = EvaluateInstruction.from_record(msg.content.config_records[CONFIG_RECORD])
    if not policy.evaluate:
        raise PrivacyRefusal("evaluate: this node answers no evaluate messages (evaluate=false)")
    # A simulated node without a declaration evaluates on the run's evaluation split.
    declared = declaration(context, cfg, policy) if node_data(context) else None
    if declared is None and policy.noise != "seeded":
        raise PrivacyRefusal("evaluate: this node declares no data (node config dataset=...)")
    model = build_model(cfg.model_name, seed=cfg.seed)
    layout = ParamLayout.from_module(model)
    update = decode_update(task.model, expected_dense_size=layout.numel)
    layout.load_flat_(model, update.to_dense())
    try:
        data = public_test_data(cfg) if declared is None else test_data(declared)
        loss, accuracy = evaluate(model, data.x, data.y)
    except Exception as err:
        raise released_error(err, data_read=True) from None
    reply = EvaluateReply(num_examples=len(data), loss=loss, accuracy=accuracy)
    return Message(
        content=RecordDict({METRICS_RECORD: MetricRecord(reply.to_record())}), reply_to=msg
    )
