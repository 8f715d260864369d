"""A node's ``SecAggClient`` to and from its ``Context.state`` values (``client/secagg.py``'s
``to_state`` and ``from_state``): private keys and shares too, so kept only on the node."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from fedsparse.common.aggregation.secure import RingParams
from fedsparse.common.wire.secagg import ALL_STAGES, RING_FIELDS, SETUP, UNMASK, SecAggError

if TYPE_CHECKING:
    from fedsparse.client.secagg import SecAggClient

__all__ = ["RoundProgress", "from_state", "to_state"]

#: The node-id -> bytes maps ``to_state`` saves as two parallel lists.
_STATE_MAPS: Final = ("pair_seed_of", "share_key_of", "seed_shares", "sk1_shares", "identity_of")


@dataclass
class RoundProgress:
    """What a node's secure aggregation holds between the stages of its round: the round it
    bound and the last stage done, its private keys, seeds, shares and the checks' results."""

    round: tuple[int, bytes] | None = None  # (round id, the server's nonce) of the setup
    done: str = UNMASK  # the last stage answered (a round starts at setup)
    # the secrets: never in a repr (a log line or a traceback's locals)
    sk1: bytes = field(default=b"", repr=False)
    sk2: bytes = field(default=b"", repr=False)
    pk1: bytes = b""
    pk2: bytes = b""
    self_seed: bytes = field(default=b"", repr=False)
    pair_seed_of: dict[int, bytes] = field(default_factory=dict, repr=False)
    share_key_of: dict[int, bytes] = field(default_factory=dict, repr=False)
    seed_shares: dict[int, bytes] = field(default_factory=dict, repr=False)
    sk1_shares: dict[int, bytes] = field(default_factory=dict, repr=False)
    masked_with: set[int] = field(default_factory=set)
    identity_of: dict[int, bytes] = field(default_factory=dict)  # advertisements verified
    enforcing: set[int] = field(default_factory=set)  # those of them signed as enforcing
    ring_digest: bytes = b""  # the ring this node was shown (``ring_digest``)
    consistent: list[int] = field(default_factory=list)  # the survivor set this node signed
    members: int = 0  # the ring's member count, from the key sharing (0: none yet)


def to_state(client: SecAggClient) -> dict[str, Any]:
    """``SecAggClient.to_state``."""
    policy, progress = client.policy, client.progress
    seed = policy.pop("noise_seed")
    state: dict[str, Any] = {
        "node_id": client.node_id,
        **{f"ring.{name}": getattr(client.params, name) for name in _RING},
        **{f"policy.{name}": policy.pop(name) for name in _POLICY_NUMBERS},
        "noise": client.noise,
        "noise_seed": -1 if seed is None else seed,
        "released": sorted(client.released_rounds),
        "policy.roster": policy.pop("roster"),
        "policy.min_trusted_peers": policy.pop("min_trusted_peers"),
        "round_id": -1 if progress.round is None else progress.round[0],
        "nonce": b"" if progress.round is None else progress.round[1],
        "done": progress.done,
        "sk1": progress.sk1,
        "sk2": progress.sk2,
        "pk1": progress.pk1,
        "pk2": progress.pk2,
        "self_seed": progress.self_seed,
        "masked_with": sorted(progress.masked_with),
        "consistent": list(progress.consistent),
        "enforcing": sorted(progress.enforcing),
        "ring_digest": progress.ring_digest,
        "members": progress.members,
    }
    assert not policy, policy  # every number of the policy is saved
    for name in _STATE_MAPS:
        mapping: dict[int, bytes] = getattr(progress, name)
        state[f"{name}.nids"] = list(mapping)
        state[f"{name}.values"] = list(mapping.values())
    return state


#: The ring's parameters saved as ``ring.<name>``.
_RING: Final = (*RING_FIELDS, "neighbours", "modular")
#: The policy's numbers saved as ``policy.<name>``, in the order earlier states have them.
_POLICY_NUMBERS: Final = ("min_noise_multiplier", "colluders", "wrap_probability", "rounding_slack")


def from_state(cls: type[SecAggClient], state: Mapping[str, Any]) -> SecAggClient:
    """``SecAggClient.from_state``."""
    try:
        # (a state saved before sparse or small rings: the complete graph, the exact ring)
        ring = {"ring.neighbours": 0, "ring.modular": False, **state}
        if not isinstance(ring["ring.modular"], bool):
            raise ValueError(f"ring.modular is {ring['ring.modular']!r}, not a bool")
        params = RingParams(**{name: ring[f"ring.{name}"] for name in _RING})
        seed = int(state["noise_seed"])
        client = cls(
            int(state["node_id"]),
            params,
            noise=state["noise"],
            noise_seed=None if seed < 0 else seed,
            released_rounds=[int(r) for r in state["released"]],
            min_noise_multiplier=float(state["policy.min_noise_multiplier"]),
            colluders=int(state["policy.colluders"]),
            wrap_probability=float(state["policy.wrap_probability"]),
            rounding_slack=float(state["policy.rounding_slack"]),
            roster=[bytes(key) for key in state["policy.roster"]],
            min_trusted_peers=int(state["policy.min_trusted_peers"]),
        )
        round_id = int(state["round_id"])
        progress = RoundProgress(
            round=None if round_id < 0 else (round_id, bytes(state["nonce"])),
            done=str(state["done"]),
            sk1=bytes(state["sk1"]),
            sk2=bytes(state["sk2"]),
            pk1=bytes(state["pk1"]),
            pk2=bytes(state["pk2"]),
            self_seed=bytes(state["self_seed"]),
            masked_with={int(n) for n in state["masked_with"]},
            consistent=[int(n) for n in state["consistent"]],
            # (absent from a state saved before rings were signed: none then)
            enforcing={int(n) for n in state.get("enforcing", [])},
            ring_digest=bytes(state.get("ring_digest", b"")),
            members=_count(state.get("members", 0)),
        )
        for name in _STATE_MAPS:
            nids, values = state[f"{name}.nids"], state[f"{name}.values"]
            pairs = zip(nids, values, strict=True)  # ValueError on different lengths
            setattr(progress, name, {int(n): bytes(v) for n, v in pairs})
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise SecAggError(
            f"secure aggregation: the node's saved state is unusable: {exc}"
        ) from None
    if progress.done not in ALL_STAGES:
        raise SecAggError(f"secure aggregation: saved stage {progress.done!r} is unknown")
    shared = progress.done not in (SETUP, UNMASK)  # its secrets are shared in a ring
    if params.neighbours and shared and not params.threshold <= progress.members <= params.clients:
        raise SecAggError(
            f"secure aggregation: the saved member count {progress.members} is not a ring's "
            f"(threshold {params.threshold}, clients {params.clients})"
        )
    client.progress = progress
    return client


def _count(value: Any) -> int:
    """A saved count: an ``int`` itself (not a float or a string that reads as one)."""
    if type(value) is not int:
        raise ValueError(f"the saved member count {value!r} is not an int")
    return value
