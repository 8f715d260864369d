"""What the server and the clients say to each other each round (names and seeds, no Flower).

Downlink (server -> client, message type ``train``), one ``ConfigRecord`` ``"fedsparse"``:
    ``round``, ``num-rounds``, ``mask-seed`` (the round seed), ``keep``, ``mask-scope``,
    ``base-version`` (model version the payload patches; -1 = dense model), ``model-version``,
    the local hyperparameters, and ``model`` (bytes: a ``SparseUpdate`` of the global model's
    VALUES on the coordinates the client is missing, so applying it is exact).
Uplink (client -> server), one ``ConfigRecord`` ``"fedsparse"`` with ``update`` (bytes: a
    ``SparseUpdate`` of the local model delta on the client's mask, values only) and a
    ``MetricRecord`` ``"metrics"`` (``num-examples``, ``train-loss``, ``epsilon``, ...).

One bytes object per direction: every record and array is its own transfer in Flower.
"""

from __future__ import annotations

from fedsparse.common.masks import derive_seed

__all__ = [
    "CONFIG_RECORD",
    "METRICS_RECORD",
    "STATE_RECORD",
    "STATE_MODEL",
    "client_mask_seed",
    "round_seed",
]

CONFIG_RECORD = "fedsparse"
METRICS_RECORD = "metrics"
STATE_RECORD = "fedsparse-state"
STATE_MODEL = "fedsparse-model"

_ROUND_STREAM = 0x5EED
_CLIENT_STREAM = 0xC11E


def round_seed(seed: int, server_round: int) -> int:
    """The mask seed the server broadcasts in round ``server_round`` (1-based)."""
    return derive_seed(seed, _ROUND_STREAM, server_round)


def client_mask_seed(round_mask_seed: int, node_id: int) -> int:
    """``mask-scope=client``: the per-client mask seed, derivable by server and client alike."""
    return derive_seed(round_mask_seed, _CLIENT_STREAM, node_id % 2**64)
