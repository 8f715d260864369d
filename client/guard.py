"""The client's privacy guard: its owner's policy and ledger, checked before any data is used.

``authorize`` runs before local training and is the only path to it: the request must pass
the node's static limits (``NodePolicy.check``), be a round strictly after the last one this
node trained in the run, and fit the budget, which the persistent ledger charges at once
(``PrivacyLedger.charge``); with no ledger (``ledger-dir=""``) the budget spans the run's own
accountant history in ``Context.state``. A refusal raises ``PrivacyRefusal``: the reply is an
error naming the limit, and nothing was trained or released.

``released_error`` keeps error replies free of data: refusals and malformed requests name
only what the server sent or the node's own limits; any other failure is reported by type,
with the details in the node's own log.
"""

from __future__ import annotations

import os
from logging import ERROR
from pathlib import Path

from flwr.app import Context
from flwr.common.logger import log

from fedsparse.common.config import FederatedConfig
from fedsparse.common.ledger import PrivacyLedger, ledger_key
from fedsparse.common.node_policy import (
    POLICY_ENV,
    NodePolicy,
    PrivacyRefusal,
    TrainingRequest,
    parse_assignments,
)
from fedsparse.common.payload import PayloadError
from fedsparse.common.privacy import compute_epsilon_of_history
from fedsparse.common.protocol import ProtocolError

__all__ = ["authorize", "node_ledger", "node_policy", "released_error"]

History = list[tuple[float, float, int]]


def node_policy(context: Context) -> NodePolicy:
    """The node's policy: defaults, then ``$FEDSPARSE_NODE_POLICY``, then the node config."""
    env = parse_assignments(os.environ.get(POLICY_ENV, ""))
    return NodePolicy.from_sources(env, dict(context.node_config))


def node_ledger(
    policy: NodePolicy, cfg: FederatedConfig, partition: tuple[int, int]
) -> PrivacyLedger | None:
    """The ledger of the data this node holds, or None with ``ledger-dir=""``."""
    if not policy.ledger_dir:
        return None
    stem = ledger_key(cfg.dataset, *partition)
    return PrivacyLedger(Path(policy.ledger_dir).expanduser() / f"{stem}.json")


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
    if request.mechanism != "dpsgd" or request.noise_multiplier == 0:
        spent = float("inf")
    else:
        entry = (request.noise_multiplier, request.sample_rate, request.steps)
        spent = compute_epsilon_of_history([*history, entry], delta=policy.delta, accountant="rdp")
        spent += index_spent + request.index_epsilon
    if spent > policy.epsilon_budget:
        raise PrivacyRefusal(
            f"epsilon={spent:.4g} at delta={policy.delta:g} after this round: over this "
            f"node's budget {policy.epsilon_budget:g}"
        )
    return spent


def released_error(err: Exception) -> Exception:
    """The error a reply may carry for ``err`` (logged here in full when it is withheld)."""
    if isinstance(err, PrivacyRefusal | ProtocolError | PayloadError):
        return err
    log(ERROR, "fedsparse client: %s: %s", type(err).__name__, err)
    return RuntimeError(f"client error: {type(err).__name__} (details in the node's log)")
