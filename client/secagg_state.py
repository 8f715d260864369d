"""A node's ``SecAggClient`` to and from its ``Context.state`` values (``client/secagg.py``'s
``to_state`` and ``from_state``): private keys and shares too, so kept only on the node."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from fedsparse.common.aggregation.secure import RingParams
from fedsparse.common.wire.secagg import ALL_STAGES, RING_FIELDS, SecAggError

if TYPE_CHECKING:
    from fedsparse.client.secagg import SecAggClient

__all__ = ["from_state", "to_state"]

#: The node-id -> bytes maps ``to_state`` saves as two parallel lists.
_STATE_MAPS: Final = ("pair_seed_of", "share_key_of", "seed_shares", "sk1_shares", "identity_of")


def to_state(self: SecAggClient) -> dict[str, Any]:
    """``SecAggClient.to_state``."""
    state: dict[str, Any] = {
        "node_id": self.node_id,
        **{f"ring.{name}": getattr(self.params, name) for name in RING_FIELDS},
        **{f"policy.{name}": value for name, value in self._policy.items()},
        "noise": self.noise,
        "noise_seed": -1 if self._noise_seed is None else self._noise_seed,
        "released": sorted(self._released),
        "policy.roster": sorted(self._roster),
        "policy.min_trusted_peers": self._min_trusted,
        "round_id": -1 if self._round is None else self._round[0],
        "nonce": b"" if self._round is None else self._round[1],
        "done": self._done,
        "sk1": self._sk1,
        "sk2": self._sk2,
        "pk1": self._pk1,
        "pk2": self._pk2,
        "self_seed": self._self_seed,
        "masked_with": sorted(self._masked_with),
        "consistent": list(self._consistent),
        "enforcing": sorted(self._enforcing),
        "ring_digest": self._ring_digest,
    }
    for name in _STATE_MAPS:
        mapping: dict[int, bytes] = getattr(self, f"_{name}")
        state[f"{name}.nids"] = list(mapping)
        state[f"{name}.values"] = list(mapping.values())
    return state


def from_state(cls: type[SecAggClient], state: Mapping[str, Any]) -> SecAggClient:
    """``SecAggClient.from_state``."""
    try:
        params = RingParams(**{name: state[f"ring.{name}"] for name in RING_FIELDS})
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
        client._round = None if round_id < 0 else (round_id, bytes(state["nonce"]))
        client._done = str(state["done"])
        for name in ("sk1", "sk2", "pk1", "pk2", "self_seed"):
            setattr(client, f"_{name}", bytes(state[name]))
        client._masked_with = {int(n) for n in state["masked_with"]}
        client._consistent = [int(n) for n in state["consistent"]]
        # (absent from a state saved before rings were signed: none then)
        client._enforcing = {int(n) for n in state.get("enforcing", [])}
        client._ring_digest = bytes(state.get("ring_digest", b""))
        for name in _STATE_MAPS:
            nids, values = state[f"{name}.nids"], state[f"{name}.values"]
            pairs = zip(nids, values, strict=True)  # ValueError on different lengths
            setattr(client, f"_{name}", {int(n): bytes(v) for n, v in pairs})
    except (KeyError, TypeError, ValueError) as exc:
        raise SecAggError(
            f"secure aggregation: the node's saved state is unusable: {exc}"
        ) from None
    if client._done not in ALL_STAGES:
        raise SecAggError(f"secure aggregation: saved stage {client._done!r} is unknown")
    return client
