"""The client's privacy guard: its owner's policy and ledger, checked before any data is used.

``authorize`` runs before local training and is the only path to it: the request must pass
the node's static limits (``NodePolicy.check``), be a round strictly after the last one this
node trained in the run, and fit the budget, which the persistent ledger charges at once
(``PrivacyLedger.charge``); with no ledger (``ledger-dir=""``) the budget spans the run's own
accountant history in ``Context.state``. A refusal raises ``PrivacyRefusal``: the reply is an
error naming the limit, and nothing was trained or released.

``released_error`` keeps error replies free of data: refusals and malformed requests name
only what the server sent or the node's own limits; any other failure, and every failure
once the node's data has been read, is one fixed line (``CLIENT_FAILURE``), with the details
in the node's own log. No observable behaviour of a node may depend on its private data
except through the accounted release: the DP mechanism itself zeroes a non-finite per-sample
gradient (``common/dp/optimizer.py``), so no single example can make a round fail, and what the
reply
says about a failure is the same whatever failed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from logging import ERROR
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.common.logger import log

from fedsparse.client.data import run_declaration
from fedsparse.client.ledger import PrivacyLedger, accounted, ledger_key, ledger_path
from fedsparse.client.node_data import NodeData
from fedsparse.client.node_policy import (
    POLICY_ENV,
    SIMULATION_NODE_POLICY,
    NodePolicy,
    PrivacyRefusal,
    TrainingRequest,
    parse_assignments,
)
from fedsparse.common.config import FederatedConfig
from fedsparse.common.dp.accounting import compute_epsilon_of_history
from fedsparse.common.wire.payload import PayloadError
from fedsparse.common.wire.protocol import ProtocolError

__all__ = [
    "CLIENT_FAILURE",
    "authorize",
    "declaration",
    "exhausted",
    "in_flower_simulation",
    "node_ledger",
    "node_policy",
    "public_size",
    "released_error",
]

History = list[tuple[float, float, int]]

#: The one error a reply carries for a failure that is not a refusal of the request.
CLIENT_FAILURE = "client error (details in the node's log)"


def node_policy(context: Context) -> NodePolicy:
    """The node's policy: defaults (``SIMULATION_NODE_POLICY`` inside Flower's simulation
    engine: ``in_flower_simulation``), then ``$FEDSPARSE_NODE_POLICY``, then the node config."""
    text = os.environ.get(POLICY_ENV, "")
    simulated = in_flower_simulation()
    key = _sources_key(text, context.node_config, simulated)
    policy = _POLICIES.get(key) if key is not None else None
    if policy is None:
        env = parse_assignments(text)
        base = dict(SIMULATION_NODE_POLICY) if simulated else {}
        policy = NodePolicy.from_sources(base, env, dict(context.node_config))
        _remember(_POLICIES, key, policy)
    return policy


#: Policies and declarations parsed in this process, by ``_sources_key`` (each a frozen
#: dataclass): a process simulating many nodes parses each node's once, not every round.
_POLICIES: dict[tuple[object, ...], NodePolicy] = {}
_DECLARED: dict[tuple[object, ...], NodeData | None] = {}


def _sources_key(text: str, node_config: Mapping[str, Any], *extra: object) -> tuple | None:
    """A memo key for what ``text`` ($FEDSPARSE_NODE_POLICY) and ``node_config`` say, values
    with their types (1, 1.0 and True differ); None (parse every time) when a source names a
    ``policy-file``, which its owner may edit between rounds, or holds an unhashable value."""
    if "policy-file" in node_config or "policy-file" in text:
        return None
    key = (text, *extra, *((k, type(v), v) for k, v in node_config.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _remember(memo: dict[tuple[object, ...], Any], key: tuple | None, value: Any) -> None:
    if key is None:
        return
    if len(memo) >= 65536:
        memo.clear()
    memo[key] = value


def in_flower_simulation() -> bool:
    """Whether this ClientApp runs in Flower's own simulation engine: inside a Ray actor of
    Flower's ``ClientAppActor`` class (``flwr run`` on a local simulation federation).

    There the experimenter plays every node owner, as in fedsparse's own backends, which set
    the simulation policy themselves. Nothing a server sends can make this true on a deployed
    node: ``fedsparse node`` runs each ClientApp in a process forked from its own forker,
    never in a Ray actor (and a plain ``flower-supernode`` runs the server's code anyway,
    outside this threat model).
    """
    ray = sys.modules.get("ray")
    if ray is None:  # a simulation's actor process has imported Ray long before
        return False
    try:
        if not ray.is_initialized():
            return False
        actor = ray.get_runtime_context().current_actor
        descriptor = actor._ray_actor_creation_function_descriptor
    except Exception:  # not in an actor (RuntimeError), or another Ray's internals
        return False
    return bool(
        descriptor.class_name == "ClientAppActor"
        and descriptor.module_name.startswith("flwr.simulation.")
    )


def node_data(context: Context) -> NodeData | None:
    """The data the node's owner declared (``client/node_data.py``), from the same sources
    as its policy; None if it declares none."""
    text = os.environ.get(POLICY_ENV, "")
    key = _sources_key(text, context.node_config)
    if key is not None and key in _DECLARED:
        return _DECLARED[key]
    declared = NodeData.from_sources(parse_assignments(text), dict(context.node_config))
    _remember(_DECLARED, key, declared)
    return declared


def node_ledger(
    policy: NodePolicy, identity: str, *, dataset: str, partition: tuple[int, int]
) -> PrivacyLedger | None:
    """The ledger of the examples whose ``data_identity`` is ``identity``, or None with
    ``ledger-dir=""``.

    ``dataset`` and ``partition`` name the ledger the node kept before ledgers were keyed on
    content (``ledger_key``): the new one starts from its entries.
    """
    if not policy.ledger_dir:
        return None
    folder = Path(policy.ledger_dir).expanduser()
    return PrivacyLedger(
        ledger_path(folder, identity),
        legacy=[folder / f"{ledger_key(dataset, *partition)}.json"],
    )


def authorize(
    policy: NodePolicy,
    ledger: PrivacyLedger | None,
    request: TrainingRequest,
    *,
    history: History,
    last_round: int,
    index_spent: float = 0.0,
) -> float:
    """Checks and charges ``request``; returns the ε at the policy's δ after it.

    Args:
        history: the run's accountant history so far (``Context.state``).
        last_round: the last round this node trained in this run (0: none).
        index_spent: GIP's index epsilon spent so far in this run (``Context.state``).

    Raises:
        PrivacyRefusal: the request breaks the policy, repeats a round or exceeds the budget.
    """
    policy.check(request)
    if request.server_round <= last_round:
        raise PrivacyRefusal(
            f"round={request.server_round}: this node already trained round {last_round} of "
            "this run; rounds must strictly increase"
        )
    if ledger is not None:
        return ledger.charge(request, budget=policy.epsilon_budget, delta=policy.delta)
    entry = accounted(
        request.mechanism, request.noise_multiplier, request.sample_rate, request.steps
    )
    if entry is None:
        spent = float("inf")
    else:
        spent = compute_epsilon_of_history([*history, entry], delta=policy.delta, accountant="rdp")
        spent += index_spent + request.index_epsilon
    if spent > policy.epsilon_budget:
        raise PrivacyRefusal(
            "this round would take the node's data past its privacy budget",
            detail=f"epsilon={spent:.4g} at delta={policy.delta:g} after this round, budget "
            f"{policy.epsilon_budget:g}",
        )
    return spent


def exhausted(policy: NodePolicy, ledger: PrivacyLedger | None) -> None:
    """Refuses at once when the ledger has no budget left (before any costly work).

    Raises:
        PrivacyRefusal: the ledger's spend is already at or past the budget.
    """
    if ledger is not None and ledger.epsilon(policy.delta) >= policy.epsilon_budget:
        raise PrivacyRefusal(
            "this node's data has no privacy budget left",
            detail=f"budget {policy.epsilon_budget:g} at delta={policy.delta:g} spent "
            f"({ledger.path})",
        )


def released_error(err: Exception, *, data_read: bool = False) -> Exception:
    """The error a reply may carry for ``err`` (logged here in full when it is withheld).

    Refusals and malformed requests pass through while nothing private has been read
    (``data_read=False``): their messages name only what the server sent and the node's
    limits. Anything else, and anything at all once the node's data has been read, becomes
    the one fixed ``CLIENT_FAILURE``.
    """
    detail = getattr(err, "detail", "")
    if isinstance(err, PrivacyRefusal) and detail:
        log(ERROR, "fedsparse client: refused: %s (%s)", err, detail)
    if not data_read and isinstance(err, PrivacyRefusal | ProtocolError | PayloadError):
        return err
    log(ERROR, "fedsparse client: %s: %s", type(err).__name__, err)
    return RuntimeError(CLIENT_FAILURE)


def declaration(context: Context, cfg: FederatedConfig, policy: NodePolicy) -> NodeData:
    """What this node holds: its owner's declaration, or (a simulated node only) the run
    config's partition. Reads no data.

    Raises:
        PrivacyRefusal: a node with fresh noise that declares no data, or no ``nominal-size``.
        ProtocolError: the run config names another dataset than the declared one.
    """
    declared = node_data(context)
    if declared is None:
        if policy.noise != "seeded":
            raise PrivacyRefusal(
                "this node declares no data: a deployed node trains only on the data its "
                "owner declares (node config dataset=... nominal-size=..., "
                "client/node_data.py)"
            )
        partition = context.node_config["partition-id"], context.node_config["num-partitions"]
        return run_declaration(cfg, int(partition[0]), int(partition[1]))
    if declared.dataset != cfg.dataset:
        raise ProtocolError(
            f"run config: dataset={cfg.dataset!r}: this node holds {declared.dataset!r}"
        )
    if declared.nominal_size == 0 and policy.noise != "seeded":
        raise PrivacyRefusal(
            "this node declares no nominal-size: a deployed node computes its sampling rate "
            "and every number it reports from the most examples it may hold, which its owner "
            "declares (node config nominal-size=N, client/node_data.py)"
        )
    return declared


def public_size(declared: NodeData, held: int) -> int:
    """The size this node's sampling rate, steps, calibration and reported numbers come from:
    its declared ``nominal-size``, or (0: a simulated node) the ``held`` examples' count.

    Raises:
        PrivacyRefusal: the node holds more examples than its ``nominal-size``; one fixed
            line, whatever the counts (they go to the node's log).
    """
    if declared.nominal_size == 0:
        return held
    if held > declared.nominal_size:
        raise PrivacyRefusal(
            "this node holds more examples than its declared nominal-size",
            detail=f"{held} examples, nominal-size={declared.nominal_size}",
        )
    return declared.nominal_size
