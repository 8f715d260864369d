"""A train message's round, in three steps any runner can call: ``prepare_train`` (the
request's checks, the downlink, the node's budget, σ's calibration and the ledger's charge:
everything before the node's round), ``client_round`` (``run_alone``, or many nodes at once in
``population_round``) and ``finish_train`` (the node's state saved, the reply).

The ClientApp's ``train`` (``client/app.py``) runs the three for one message;
``client/train_batch.py: train_population`` for a batch of messages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from logging import ERROR
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common.logger import log

from fedsparse.client import model_cache
from fedsparse.client.data import holding
from fedsparse.client.guard import (
    authorize,
    declaration,
    exhausted,
    node_ledger,
    node_policy,
    public_size,
    released_error,
)
from fedsparse.client.local_round import (
    PublicRound,
    Release,
    RoundNoise,
    RoundPrivacy,
    RoundResult,
    client_round,
)
from fedsparse.client.node_data import NodeData
from fedsparse.client.node_policy import SECAGG, NodePolicy, PrivacyRefusal, TrainingRequest
from fedsparse.client.population import ClientCall
from fedsparse.client.secagg_node import SecAggRound, sample_level_multiplier
from fedsparse.client.state import (
    NodeState,
    StateFiles,
    apply_downlink,
    residual_bytes,
    residual_vector,
    resumed_from,
)
from fedsparse.common.config import FederatedConfig
from fedsparse.common.dp.accounting import (
    AccountantName,
    calibrate_noise_multiplier,
    compute_epsilon_of_history,
    sample_rate,
    steps_per_epoch,
)
from fedsparse.common.known_warnings import quiet_known_warnings
from fedsparse.common.layout import ParamLayout
from fedsparse.common.methods.base import Method
from fedsparse.common.methods.index_selection import IndexBudget
from fedsparse.common.training.configs import PrivacyConfig, planned_engine, resolve_device
from fedsparse.common.wire.protocol import (
    CONFIG_RECORD,
    DOWNLINK_KIND,
    METRICS_RECORD,
    SERVER_SUPPORT,
    ProtocolError,
    TrainInstruction,
    TrainReply,
    typed_record,
)
from fedsparse.common.wire.secagg import SECAGG_RECORD

__all__ = [
    "PreparedTrain",
    "finish_train",
    "node_accountant",
    "prepare_train",
    "run_alone",
    "run_config",
]


def run_config(context: Context, policy: NodePolicy) -> FederatedConfig:
    """The run config, parsed once the node's policy allows its plug-ins: a plug-in method,
    model or engine (``package.module:attribute``) is imported only if the node's owner lists
    it or the node is simulated; else refused before anything is imported.

    Raises:
        PrivacyRefusal: a plug-in the policy does not list.
    """
    policy.check_plugins(context.run_config)
    try:  # every message of a run carries the same one (parsing it: ~0.2 ms)
        key = tuple((k, type(v), v) for k, v in context.run_config.items())
        hash(key)
    except TypeError:  # a value Flower's run config never holds: parse it every time
        return FederatedConfig.from_run_config(context.run_config)
    cfg = _PARSED.get(key)
    if cfg is None:
        if len(_PARSED) >= 16:
            _PARSED.clear()
        cfg = _PARSED[key] = FederatedConfig.from_run_config(context.run_config)
    return cfg


#: Parsed run configs by their items and types (1, 1.0, True: equal keys, not equal values).
_PARSED: dict[tuple[tuple[str, type, object], ...], FederatedConfig] = {}


def _calibrated(
    privacy: PrivacyConfig,
    cfg: FederatedConfig,
    num_examples: int,
    accountant: AccountantName,
    method: Method | None = None,
) -> tuple[PrivacyConfig, IndexBudget | None]:
    """``privacy`` with sigma calibrated for the whole run's steps, if it has a target epsilon;
    and the method's own budget (``Method.split_privacy``: gip's index budget ``eps2``, sigma
    then calibrating ``eps1``).

    Calibrated for the worst case: this client trains in every round. The search depends
    only on the run config and the node's public size (``public_size``: its declared
    ``nominal-size``), so every round after a node's first (and every node with the same
    ``q``) gets it from ``calibrate_noise_multiplier``'s memo.
    ``accountant`` is the one the search runs with (``node_accountant``); ``method`` the
    round's instance (None: a new one).

    Raises:
        ProtocolError: no noise multiplier reaches the target; the message names only the
            server's target (whether it is reached depends on public values only).
    """
    steps = cfg.num_rounds * cfg.local_epochs * steps_per_epoch(num_examples, cfg.batch_size)
    method = method if method is not None else cfg.make_method()
    privacy, budget = method.split_privacy(privacy, planned_steps=steps)
    if privacy.target_epsilon is None:
        return privacy, budget
    try:
        sigma = calibrate_noise_multiplier(
            target_epsilon=privacy.target_epsilon,
            delta=privacy.delta,
            sample_rate=sample_rate(num_examples, cfg.batch_size),
            steps=steps,
            accountant=accountant,
        )
    except ValueError as err:
        log(ERROR, "fedsparse client: calibration failed: %s", err)
        raise ProtocolError(
            f"run config: target-epsilon={privacy.target_epsilon:g}: no noise multiplier "
            "reaches it for this node's nominal-size and the run's steps"
        ) from None
    return dataclasses.replace(privacy, noise_multiplier=sigma, target_epsilon=None), budget


def node_accountant(policy: NodePolicy, privacy: PrivacyConfig) -> AccountantName:
    """The accountant a node calibrates σ with: the run's on a simulated node (seeded noise,
    reproducing the experiment exactly), else ``rdp``, the one its ledger composes with, so
    that the ledger charges the target ε it calibrated for and no run config can make a
    calibration cost more than a fraction of a second."""
    return privacy.accountant if policy.noise == "seeded" else "rdp"


def _index_charge(
    cfg: FederatedConfig,
    task: TrainInstruction,
    numel: int,
    budget: IndexBudget | None,
    steps: int,
    method: Method | None = None,
) -> tuple[float, float]:
    """(this round's keep ratio k, its index epsilon for ``steps``): ``Method.index_charge``.

    gip, random-k: ``k`` is the public schedule's, ``1 - r(round)``; the instruction's
    ``keep`` must be ``keep_count(d, r)`` (the server cannot buy a costlier selection). The
    methods with one mask a round: (1, 0).

    Raises:
        ProtocolError: another ``keep`` (checked before anything private is touched).
    """
    schedule = cfg.sparsity().rate_schedule(cfg.num_rounds)
    method = method if method is not None else cfg.make_method()
    return method.index_charge(task, numel, budget, steps, schedule=schedule)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreparedTrain:
    """A train message checked, its round authorized and charged: what ``client_round``
    needs (``call``) and what ``finish_train`` saves and replies with."""

    msg: Message
    context: Context
    cfg: FederatedConfig
    task: TrainInstruction
    policy: NodePolicy
    state: NodeState
    files: StateFiles | None
    reusable: model_cache.ProcessModel
    call: ClientCall
    secagg: SecAggRound | None


def prepare_train(msg: Message, context: Context) -> PreparedTrain:
    """``train`` up to the round itself: the request's checks, the downlink, the node's budget,
    σ's calibration and the ledger's charge (``_authorized``).

    Raises:
        PrivacyRefusal, ProtocolError: named refusals (the policy's, the ledger's, the
            request's); any other failure once the node's data is read is
            ``released_error``'s fixed one.
    """
    torch.set_num_threads(1)
    policy = node_policy(context)
    cfg = run_config(context, policy)
    resolve_device(cfg.device)  # device='cuda' without one: a config error, named in the reply
    record = typed_record(msg.content, CONFIG_RECORD, ConfigRecord)
    task = TrainInstruction.from_record(record)
    privacy = cfg.privacy()
    secure = cfg.secure_aggregation  # the release is the masked input (client/secagg_node.py)
    policy.precheck(
        mechanism=SECAGG if secure else privacy.mechanism,
        local_epochs=task.local_epochs,
        noise_multiplier=None
        if secure or privacy.target_epsilon is not None
        else privacy.noise_multiplier,
        batch_size=None if secure else task.batch_size,
    )
    declared = declaration(context, cfg, policy)
    secagg = SecAggRound.open(msg, context, cfg, policy, task, declared) if secure else None
    reusable = model_cache.process_model(cfg.model_name, cfg.seed)
    planned_engine(cfg.engine, cfg.model_name, cfg.device)  # it trains the model: no charge yet
    layout = reusable.layout
    method = cfg.make_method()  # one instance for the round
    frozen = _frozen_prefix(cfg, task, layout, method)
    explicit = _server_support(cfg, task, record, layout, method)
    partition = (declared.partition_id, declared.num_partitions)
    files = StateFiles(Path(policy.state_dir), partition[0]) if policy.state_dir else None
    state = _node_state(context, files, resumed_from(record), numel=layout.numel)
    global_flat = apply_downlink(
        state.model,
        state.version,
        task.model,
        base_version=task.base_version,
        numel=layout.numel,
        server_round=task.server_round,
        kind=record.get(DOWNLINK_KIND, "values"),
    )
    public = PublicRound(
        cfg=cfg, task=task, method=method, node_id=context.node_id, frozen=frozen, explicit=explicit
    )
    try:  # from here on the node's data is read: refusals by name, anything else fixed
        call = _authorized(
            cfg,
            task,
            policy,
            privacy,
            context,
            declared,
            state,
            layout,
            public,
            global_flat,
            secagg,
        )
    except (PrivacyRefusal, ProtocolError):
        raise  # the policy's, the ledger's or the request's: named, no private numbers
    except Exception as err:
        raise released_error(err, data_read=True) from None
    return PreparedTrain(
        msg=msg,
        context=context,
        cfg=cfg,
        task=task,
        policy=policy,
        state=state,
        files=files,
        reusable=reusable,
        call=call,
        secagg=secagg,
    )


def _authorized(
    cfg: FederatedConfig,
    task: TrainInstruction,
    policy: NodePolicy,
    privacy: PrivacyConfig,
    context: Context,
    declared: NodeData,
    state: NodeState,
    layout: ParamLayout,
    public: PublicRound,
    global_flat: torch.Tensor,
    secagg: SecAggRound | None,
) -> ClientCall:
    """The part of ``prepare_train`` that reads the node's data: budget, σ, the ledger's
    charge; returns the round's ``client_round`` arguments.

    Raises:
        PrivacyRefusal: the budget is spent or the round does not fit it.
        ProtocolError: the request does not fit the public config (e.g. its ``keep``).
    """
    partition = (declared.partition_id, declared.num_partitions)
    held = holding(declared)
    data = held.train
    size = public_size(declared, len(data))
    ledger = (  # the content hash only where a ledger needs it
        node_ledger(policy, held.identity, dataset=declared.dataset, partition=partition)
        if policy.ledger_dir
        else None
    )
    exhausted(policy, ledger)
    if secagg is not None:
        secagg.ledger = ledger
    method = public.method
    with quiet_known_warnings():
        accountant = node_accountant(policy, privacy)
        privacy, budget = _calibrated(privacy, cfg, size, accountant, method)
        steps = task.local_epochs * steps_per_epoch(size, task.batch_size)
        keep_fraction, index_epsilon = _index_charge(cfg, task, layout.numel, budget, steps, method)
        request = TrainingRequest(
            run_id=context.run_id,
            server_round=task.server_round,
            mechanism=privacy.mechanism,
            noise_multiplier=float(privacy.noise_multiplier or 0.0),
            sample_rate=sample_rate(size, task.batch_size),
            steps=steps,
            local_epochs=task.local_epochs,
            index_epsilon=index_epsilon,
            calibrated=cfg.privacy().target_epsilon is not None,
        )
        if secagg is not None:  # one release of the clipped update, the node's share of noise
            request = dataclasses.replace(
                request,
                mechanism=SECAGG,
                noise_multiplier=secagg.worst_case,
                sample_rate=1.0,
                steps=1,
                calibrated=False,
            )
        authorize(
            policy,
            ledger,
            request,
            history=state.history,
            last_round=state.last_round,
            index_spent=state.index_epsilon,
        )
    return ClientCall(
        global_flat=global_flat,
        examples=data,
        public=public,
        privacy=RoundPrivacy(
            privacy=privacy,
            history=state.history,
            index_spent=state.index_epsilon,
            keep_fraction=keep_fraction,
            budget=budget,
            # padded to the declared size (a simulated node declaring none: its own)
            nominal_size=declared.nominal_size or None,
        ),
        # Seeded streams only when the node asks (simulation); else fresh OS entropy.
        noise=RoundNoise(
            seeded=policy.noise == "seeded", run_seed=cfg.seed, partition_id=partition[0]
        ),
        release=Release(policy.release_example_count, policy.release_train_loss),
        # error-feedback: the node's residual (checked when the state was read), else None
        residual=residual_vector(state.residual, layout.numel) if cfg.error_feedback else None,
    )


def run_alone(prepared: PreparedTrain) -> RoundResult:
    """The prepared round, trained by ``client_round`` on the process's model.

    Raises:
        Exception: ``released_error``'s fixed one if the round fails.
    """
    call = prepared.call
    try:
        with prepared.reusable.lock:
            return client_round(
                call.global_flat,
                call.examples,
                call.public,
                call.privacy,
                call.noise,
                model=prepared.reusable.model,
                release=call.release,
                residual=call.residual,
            )
    except Exception as err:
        raise released_error(err, data_read=True) from None


def finish_train(prepared: PreparedTrain, result: RoundResult) -> Message:
    """``train``'s reply from the round's result: the node's state saved, then the update
    (or, under secure aggregation, the keys: the values stay in the node's state).

    Raises:
        Exception: ``released_error``'s fixed one if anything fails.
    """
    try:
        reply = _save_state(prepared, result)
        config, metrics = reply.to_records()
        if prepared.secagg is not None:  # the keys go up; the values stay in the node's state
            keys = prepared.secagg.finish_train(reply.update, prepared.context)
            content = RecordDict(
                {SECAGG_RECORD: ConfigRecord(keys), METRICS_RECORD: MetricRecord(metrics)}
            )
            return Message(content=content, reply_to=prepared.msg)
    except (PrivacyRefusal, ProtocolError):
        raise
    except Exception as err:
        raise released_error(err, data_read=True) from None
    content = RecordDict(
        {CONFIG_RECORD: ConfigRecord(config), METRICS_RECORD: MetricRecord(metrics)}
    )
    return Message(content=content, reply_to=prepared.msg)


def _save_state(prepared: PreparedTrain, result: RoundResult) -> TrainReply:
    """The node's state after the round (``Context.state`` and its files); the reply, with
    the worst case under secure aggregation."""
    state, secagg, task = prepared.state, prepared.secagg, prepared.task
    reply, history = result.reply, result.history
    if secagg is not None:  # what the node's data spent: its worst case (secagg_node.py)
        history = [*state.history, (sample_level_multiplier(secagg.worst_case), 1.0, 1)]
        epsilon = compute_epsilon_of_history(history, delta=prepared.policy.delta, accountant="rdp")
        reply = dataclasses.replace(reply, epsilon=epsilon, noise_multiplier=secagg.worst_case)
    after = NodeState(
        prepared.call.global_flat,
        task.model_version,
        history,
        task.server_round,
        result.index_spent,
        residual_bytes(result.residual) if result.residual is not None else b"",
    )
    after.save(prepared.context)
    if prepared.files is not None:
        prepared.files.save(after)
    return reply


def _frozen_prefix(
    cfg: FederatedConfig, task: TrainInstruction, layout: ParamLayout, method: Method | None = None
) -> int:
    """The frozen coordinate prefix this round (lf from freeze-after on; else 0):
    ``Method.client_frozen``.

    Raises:
        ProtocolError: the instruction's ``keep`` is not the ``d - s`` the public config gives
            (checked before anything private is touched).
    """
    method = method if method is not None else cfg.make_method()
    return method.client_frozen(task, layout)


def _server_support(
    cfg: FederatedConfig,
    task: TrainInstruction,
    record: Mapping[str, Any],
    layout: ParamLayout,
    method: Method | None = None,
) -> torch.Tensor | None:
    """The server's support this round (None: every coordinate, or the seeded mask):
    ``Method.client_support``.

    The server chooses which coordinates, never how many: under ranked ``keep`` must be the
    public schedule's (or ``d`` when the server has nothing to rank yet), under dpssgd every
    layer must hold its own ``keep_count(n_layer, final-rate)``.

    Raises:
        ProtocolError: a support under a method that takes none, an undecodable bitmap, or
            counts other than the public config's (checked before anything private is touched).
    """
    method = method if method is not None else cfg.make_method()
    return method.client_support(
        task,
        record.get(SERVER_SUPPORT),
        layout,
        schedule=cfg.sparsity().rate_schedule(cfg.num_rounds),
        final_rate=cfg.final_rate,
    )


def _node_state(
    context: Context, files: StateFiles | None, resumed: int, *, numel: int
) -> NodeState:
    """The node's state in this run: ``Context.state``, or on first contact its files.

    On a node's first train call of a Flower run (empty ``Context``) with a ``state-dir``, the
    files of rounds after the resume point are dropped (all of them in a new run) and a
    resumed run continues from the latest remaining one (``client/state.py``).
    """
    if files is None or NodeState.in_context(context):
        return NodeState.load(context, numel)
    files.discard_after(resumed)
    return files.restore(up_to=resumed, numel=numel) if resumed else NodeState()
