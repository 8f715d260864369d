"""Secure aggregation on a Flower node: the train call opens the round, ``query.secagg`` runs it.

With ``secure-aggregation=true`` (``dp-level=user``) the server's train message carries the
setup stage of the round's secure sum (``SECAGG_RECORD``, ``common/wire/secagg.py``). The node
checks the ring against its own policy (``SecAggClient``: its ``min-noise-multiplier`` on the
worst case, its ``secagg-colluders``) before it reads any data, charges its ledger the worst
case, trains, and replies its two public keys with the train metrics, **not** its update:
the update's kept values stay in the node's own ``Context.state`` (``STATE_VALUES``), beside
the state of its ``SecAggClient`` (``STATE_CLIENT``: private keys and shares, never sent).
The next three stages come as ``query.secagg`` messages (``answer``); at the collect stage
the node clips the stored values to ``central-clip``, rounds them into the ring, adds its
noise share and masks them. The server decodes the survivors' sum only
(``server/secagg_round.py``; docs/explanation/secure-aggregation.md).

**What a node is charged.** Its masked input releases its clipped values plus its own noise
share, ``σ/√t`` of the central σ (``worst_case_noise_multiplier``): what protects it should
every other client collude with the server or the server lie (the threat model). Adding or
removing one example moves a clipped update by up to ``2C``, so for its data the release is a
Gaussian mechanism of multiplier ``σ_wc / 2``, at sampling rate 1 (the server's sampling of
users is not the node's to trust), one step a round. The ledger holds ``σ_wc`` under the
mechanism ``secagg`` and accounts it so (``client/ledger.py: accounted``); the reply's
``epsilon`` is that worst case over the run, and the server's user-level ε is the central one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedsparse.client.guard import node_policy
from fedsparse.client.ledger import PrivacyLedger
from fedsparse.client.node_data import NodeData
from fedsparse.client.node_policy import NodePolicy, PrivacyRefusal
from fedsparse.client.secagg import SecAggClient, SecAggInputError
from fedsparse.client.secagg_identity import Identity, load_roster
from fedsparse.common.aggregation.secure import (
    RingParams,
    worst_case_noise_multiplier,
)
from fedsparse.common.config import FederatedConfig
from fedsparse.common.seeds import Stream, client_train_seed, stream_seed
from fedsparse.common.wire.payload import decode_update
from fedsparse.common.wire.protocol import TrainInstruction
from fedsparse.common.wire.secagg import (
    COLLECT,
    CONSISTENCY,
    RING_FIELDS,
    SECAGG_RECORD,
    SETUP,
    SHARE_KEYS,
    STAGE,
    UNMASK,
    SecAggError,
    check_payload,
)

__all__ = [
    "SecAggRound",
    "answer",
    "sample_level_multiplier",
]

#: ``Context.state`` records: the node's ``SecAggClient`` and the round's kept values.
STATE_CLIENT: Final = "fedsparse.secagg.client"
STATE_VALUES: Final = "fedsparse.secagg.values"
STATE_LEDGER: Final = "fedsparse.secagg.ledger"
_LEDGER_KEY: Final = "path"
_VALUES_KEY: Final = "values"


def sample_level_multiplier(worst_case: float) -> float:
    """The Gaussian multiplier one round's release gives a node's data at example level: its
    clipped update moves by up to ``2C`` when one example is added or removed."""
    return worst_case / 2.0


class SecAggRound:
    """A node's secure-aggregation round, opened from the train message's setup payload.

    Raises (``open``): ``SecAggError`` for a malformed setup or a ring the node's policy
    refuses; ``PrivacyRefusal`` where the policy refuses secure aggregation itself.
    """

    def __init__(self, client: SecAggClient, setup: dict[str, Any]) -> None:
        self.client = client
        self.setup = setup
        #: the node's ledger (None: a simulated node without one), where the collect stage
        #: marks the round released (``PrivacyLedger.release_once``)
        self.ledger: PrivacyLedger | None = None

    @property
    def params(self) -> RingParams:
        return self.client.params

    @property
    def worst_case(self) -> float:
        """The node's own noise multiplier on its release: its share alone."""
        return worst_case_noise_multiplier(self.client.params)

    @classmethod
    def open(
        cls,
        msg: Message,
        context: Context,
        cfg: FederatedConfig,
        policy: NodePolicy,
        task: TrainInstruction,
        declared: NodeData,
    ) -> SecAggRound:
        if policy.secure_aggregation == "refuse":
            raise PrivacyRefusal(
                "secure-aggregation=true: this node's policy refuses secure aggregation"
            )
        if not policy.ledger_dir and policy.noise != "seeded":  # where release_once lives
            raise PrivacyRefusal(
                "secure-aggregation=true: this node releases a masked input only with its "
                "ledger (node policy ledger-dir), which holds one release per round"
            )
        record = msg.content.config_records.get(SECAGG_RECORD)
        if record is None:
            raise SecAggError(f"secure aggregation: the train message has no {SECAGG_RECORD!r}")
        payload = dict(record)
        setup = check_payload(payload, SETUP, "down")
        if setup["round_id"] != task.server_round:
            raise SecAggError(
                f"secure aggregation, stage 'setup': field 'round_id' is {setup['round_id']}, "
                f"the train instruction's round {task.server_round}"
            )
        # The run config's public parameters, not the server's word for them. Under
        # central-target-epsilon sigma is the server's calibration: the node's guarantee is its
        # worst case, checked against its own policy (SecAggClient) and charged to its ledger.
        pinned = [("clip", cfg.central_clip), ("neighbours", cfg.secagg_neighbours)]
        pinned.append(("modular", int(cfg.secagg_ring_bits > 0)))
        if cfg.secagg_ring_bits:  # a small ring: its width is the run config's
            pinned.append(("bits", cfg.secagg_ring_bits))
        if not cfg.central_target_epsilon:
            pinned.append(("sigma", cfg.central_noise_multiplier))
        setup.setdefault("neighbours", 0)  # absent: the complete graph
        setup.setdefault("modular", 0)  # absent: the exact ring
        for name, value in pinned:
            if setup[name] != value:
                raise SecAggError(
                    f"secure aggregation, stage 'setup': field {name!r} is {setup[name]!r}, "
                    f"the run config says {value!r}"
                )
        try:  # the ring itself is checked against the node's policy by SecAggClient
            params = RingParams(
                **{name: setup[name] for name in RING_FIELDS},
                neighbours=setup["neighbours"],
                modular=bool(setup["modular"]),
            )
        except ValueError as exc:
            raise SecAggError(f"secure aggregation, stage 'setup': ring refused: {exc}") from None
        identity = Identity.load(policy.secagg_identity) if policy.secagg_identity else None
        roster = load_roster(policy.secagg_roster) if policy.secagg_roster else frozenset()
        seeded = policy.noise == "seeded" and not cfg.secure_mode
        released = _saved(context).released_rounds if STATE_CLIENT in context.state else ()
        client = SecAggClient(
            context.node_id,
            params,
            # the floor holds for what the node's data sees, sigma_wc / 2 (as for dpsgd)
            min_noise_multiplier=2.0 * policy.min_noise_multiplier,
            colluders=policy.secagg_colluders,
            noise="seeded" if seeded else "fresh",
            noise_seed=stream_seed(
                client_train_seed(cfg.seed, 0, declared.partition_id), Stream.SECAGG_NOISE
            )
            if seeded
            else None,
            released_rounds=released,
            identity=identity,
            roster=roster,
            min_trusted_peers=policy.secagg_min_trusted,
        )
        return cls(client, payload)

    def finish_train(self, update: bytes, context: Context) -> dict[str, Any]:
        """The setup reply (two public keys); keeps the update's kept values and the client
        in ``context.state`` for the later stages.

        Raises:
            SecAggInputError: the update does not hold the ring's ``kept`` values.
        """
        values = decode_update(update).values.to(torch.float32)
        if values.numel() != self.params.kept:
            raise SecAggInputError(
                f"secure aggregation: the update has {values.numel()} values, the ring "
                f"{self.params.kept}"
            )
        reply = self.client.handle(self.setup)
        _save(context, self.client, values)
        ledger = "" if self.ledger is None else str(self.ledger.path)
        context.state.config_records[STATE_LEDGER] = ConfigRecord({_LEDGER_KEY: ledger})
        return reply


def _answer_once(
    context: Context, client: SecAggClient, stage: str, active: list[int], ring: bytes = b""
) -> None:
    """Two copies of a stage's message handled at once read the same state: the ledger's
    file, under its lock, lets one ring share the node's secrets (share keys: the ring's
    digest, ``ring``; the same ring again is the same shares' content), one survivor set be
    signed and one unmask answered, for that same set (``active``, the stage's survivor set):
    a signature binds the unmask even of a copy of the state that never saw the consistency
    stage (a reviewer's races: two rings shown two copies of one share-keys message got one
    node's sk1 shared in both)."""
    record = context.state.config_records.get(STATE_LEDGER)
    saved = str(record.get(_LEDGER_KEY, "")) if record is not None else ""
    if not saved:
        if client.noise == "fresh":
            raise SecAggError("secure aggregation: this node kept no ledger for the round")
        return  # a simulation's seeded node
    assert client.round_id is not None
    nonce = client.nonce
    assert nonce is not None
    ledger = PrivacyLedger(Path(saved))
    if stage == SHARE_KEYS:
        ledger.answer_once(context.run_id, client.round_id, stage, ring.hex(), nonce=nonce)
        return
    survivors = ",".join(map(str, sorted(active)))
    other = UNMASK if stage == CONSISTENCY else CONSISTENCY
    again = stage == CONSISTENCY  # the same set signed twice is one signature's content
    ledger.answer_once(
        context.run_id, client.round_id, stage, survivors, nonce=nonce, binds=other, again=again
    )


def _saved(context: Context) -> SecAggClient:
    return SecAggClient.from_state(dict(context.state.config_records[STATE_CLIENT]))


def _save(context: Context, client: SecAggClient, values: torch.Tensor | None) -> None:
    context.state.config_records[STATE_CLIENT] = ConfigRecord(client.to_state())
    if values is not None:
        context.state.array_records[STATE_VALUES] = ArrayRecord(
            {_VALUES_KEY: Array(values.detach().cpu().numpy())}
        )


def answer(msg: Message, context: Context) -> Message:
    """The reply to a ``query.secagg`` stage (share keys, collect, unmask).

    The stage runs on the node's saved client; at the collect stage on its saved values,
    which are then dropped from the node's state. Raises ``SecAggError`` (the reply's error,
    naming the stage and field) for anything the client refuses; nothing is saved then.
    """
    record = msg.content.config_records.get(SECAGG_RECORD)
    if record is None:
        raise SecAggError(f"secure aggregation: the message has no {SECAGG_RECORD!r}")
    if STATE_CLIENT not in context.state.config_records:
        raise SecAggError("secure aggregation: this node opened no round (no train call)")
    payload = dict(record)
    if payload.get(STAGE) == SETUP:
        raise SecAggError("secure aggregation: the setup stage comes with the train message")
    client = _saved(context)
    if payload.get(STAGE) in (SHARE_KEYS, CONSISTENCY):  # its identity signs ring and set
        path = node_policy(context).secagg_identity
        client.identity = Identity.load(path) if path else None
    values = None
    if payload.get(STAGE) == COLLECT:
        stored = context.state.array_records.get(STATE_VALUES)
        if stored is None:
            raise SecAggError("secure aggregation: this node holds no values for the round")
        values = torch.from_numpy(stored[_VALUES_KEY].numpy().copy())
        record = context.state.config_records.get(STATE_LEDGER)
        saved = str(record.get(_LEDGER_KEY, "")) if record is not None else ""
        if not saved and client.noise == "fresh":
            raise SecAggError("secure aggregation: this node kept no ledger for the round")
        if saved and client.round_id is not None:  # once per round, whatever the state says
            PrivacyLedger(Path(saved)).release_once(context.run_id, client.round_id)
    reply = client.handle(payload, values)
    if payload.get(STAGE) == SHARE_KEYS:  # one ring a round: its sk1 is shared in one ring
        _answer_once(context, client, SHARE_KEYS, [], ring=client.ring_digest)
    if payload.get(STAGE) in (CONSISTENCY, UNMASK):  # once a round, whatever the state says
        active = payload["active_nids"]  # checked by the stage (check_payload): ints
        survivors = [int(n) for n in active] if isinstance(active, list) else []
        _answer_once(context, client, str(payload[STAGE]), survivors)
    _save(context, client, None)
    if values is not None:  # released once: nothing of it stays beside the client
        del context.state.array_records[STATE_VALUES]
    return Message(RecordDict({SECAGG_RECORD: ConfigRecord(reply)}), reply_to=msg)
