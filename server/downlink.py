"""The downlink cache: which global-model version each node holds, and what it is missing.

A node that has never trained gets the dense model. A node that holds the previous version
gets only the coordinates the last round changed: the previous round's seeded mask travels
as values only (every party regenerates it from the seed); any other gap travels as the union
of the changed coordinates with an explicit support (``auto`` encoding), or dense when that is
smaller. Applying the payload on the node is exact, so the node's copy equals the server's.
Downloads carry global-model VALUES in fp32 (never quantized: the global model is not a noisy
update) with the run's codec and compression for the support.

A lossy ``downlink-dtype`` (fp16, bf16, int8, int4, int2, int1) changes what a node one version
behind receives: ``lossy_round`` encodes the round's model change on the round's public
support (the seeded mask, or every coordinate in a dense round) in that dtype, decodes it, and
the server's new global model is the previous one plus the DECODED change, computed as the
node computes it (``client/state.py: apply_downlink``), so the node's copy and the server's
model are equal bit for bit. Such a node gets that payload (``kind`` ``"delta"``, the
train message's ``downlink-kind``); every other node gets exact fp32 values of the server's
(already decoded) model as above. The stochastic rounding of int4/int2/int1 draws from
``Stream.DOWNLINK_ROUNDING`` under the run seed and the round, not from OS entropy: the change
is post-processing of an already-noised aggregate that every selected node receives anyway,
so a predictable rounding reveals nothing, and a resumed run rounds as the uninterrupted one.
A change that overflows the dtype (fp16 past 65504) travels as exact values that round.

A round's payload depends only on the version a node holds (its base), so ``payloads``
encodes each base once, lazily, and the nodes with the same base share one ``bytes`` object:
one dense encoding, one seeded mask and at most one union per base a round. ``payload`` is the
per-node reference it equals byte for byte (``tests/server/test_downlink_cache.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from fedsparse.common.config import CodecName, FederatedConfig
from fedsparse.common.masks import seeded_mask
from fedsparse.common.seeds import Stream, stream_seed
from fedsparse.common.wire.payload import (
    DEFAULT_VALUE_BLOCK,
    Compression,
    PayloadDType,
    SparseUpdate,
    decode_update,
    encode_update,
)
from fedsparse.common.wire.protocol import DOWNLINK_KINDS
from fedsparse.common.wire.value_formats import wire_encoding

__all__ = ["DownlinkCache", "add_delta"]


def add_delta(model: torch.Tensor, delta: SparseUpdate) -> torch.Tensor:
    """``model`` plus the decoded ``delta`` on its support, in float32: the one expression the
    server and every node evaluate (``client/state.py`` spells it alike), so they agree bit for
    bit."""
    flat = model.clone()
    support = delta.support(shared=True)  # read only
    if support is None:
        flat += delta.values
    else:
        flat[support] += delta.values
    return flat


@dataclass
class DownlinkCache:
    """Per-node model versions and per-version changed coordinates."""

    codec: CodecName = "values"
    compression: Compression = "none"
    versions: dict[int, int] = field(default_factory=dict)  # node -> version it holds
    touched: dict[int, torch.Tensor] = field(default_factory=dict)  # version -> changed coords
    seeded: dict[int, tuple[int, int]] = field(default_factory=dict)  # version -> (seed, keep)
    dtype: PayloadDType = "fp32"  # downlink-dtype: fp32 sends values only, exact
    value_block: int = DEFAULT_VALUE_BLOCK
    seed: int = 0  # the run's seed (the lossy rounding's stream)
    deltas: dict[int, bytes] = field(default_factory=dict)  # version -> its encoded change

    @classmethod
    def for_run(cls, cfg: FederatedConfig) -> DownlinkCache:
        """The cache of a run configured by ``cfg`` (codec, compression, downlink-dtype)."""
        return cls(
            codec=cfg.codec,
            compression=cfg.compression,
            dtype=cfg.downlink_dtype,
            value_block=cfg.value_block,
            seed=cfg.seed,
        )

    def lossy_round(
        self,
        version: int,
        before: torch.Tensor,
        after: torch.Tensor,
        *,
        mask: tuple[int, int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The model the server adopts for ``version`` under a lossy ``dtype``, and its
        changed coordinates: ``before`` plus the decoded change ``after - before`` on the
        round's support (``mask``: its ``(seed, keep)``; None: every coordinate). None: fp32,
        a change the dtype cannot hold, or one whose rounding would overflow the model
        (``after`` stands, sent as exact values).
        """
        if self.dtype == "fp32":
            return None
        d = before.numel()
        touched = (
            torch.ones(d, dtype=torch.bool) if mask is None else seeded_mask(d, mask[1], mask[0])
        )
        change = (after - before)[touched]
        rounding = np.random.default_rng(stream_seed(self.seed, Stream.DOWNLINK_ROUNDING, version))
        try:
            payload = encode_update(
                change,
                dense_size=d,
                round=version + 1,  # sent in the next round, to the nodes holding version - 1
                mask_seed=None if mask is None else mask[0],
                encoding=wire_encoding(self.codec, sparse=mask is not None),
                value_dtype=self.dtype,
                value_block=self.value_block,
                rounding=rounding,
                compression=self.compression,
            )
        except ValueError:  # the change overflows the dtype: exact values this round
            return None
        decoded = decode_update(payload, expected_dense_size=d, expected_round=version + 1)
        adopted = add_delta(before, decoded)
        # rounding can move a value past the exact change (int1 sends a zero as +-the block's
        # largest): near the float32 limit that overflows a model the exact aggregate kept
        # finite, so this round's change goes as exact values instead
        if not bool(torch.isfinite(adopted).all()):
            return None
        self.deltas = {version: payload}  # only the latest version's change is ever sent
        return adopted, touched

    def kind(self, base: int, version: int) -> str:
        """What a payload patching ``base`` to ``version`` holds (``DOWNLINK_KINDS``):
        ``"delta"`` for a lossy round's change, else ``"values"``."""
        lossy = base >= 0 and base + 1 == version and version in self.deltas
        return DOWNLINK_KINDS[1] if lossy else DOWNLINK_KINDS[0]

    def record_version(
        self, version: int, touched: torch.Tensor, *, seeded: tuple[int, int] | None
    ) -> None:
        """Records what changed from ``version - 1`` to ``version``.

        Args:
            touched: boolean mask of the coordinates that changed.
            seeded: ``(mask seed, keep)`` when ``touched`` is exactly that seeded mask, so
                nodes one version behind can be sent values only.
        """
        self.touched[version] = touched
        if seeded is not None:
            self.seeded[version] = seeded

    def node_applied(self, node: int, version: int) -> None:
        """The node patched its copy to ``version`` (it replied to that round)."""
        self.versions[node] = version

    def forget(self, node: int) -> None:
        """The node's state is unknown (it failed): it gets the dense model next time."""
        self.versions.pop(node, None)

    def payloads(
        self, nodes: Iterable[int], weights: torch.Tensor, *, version: int, server_round: int
    ) -> dict[int, tuple[bytes, int]]:
        """``payload`` for each of ``nodes``, each distinct base encoded once.

        Equal to ``{node: payload(node, ...)}`` byte for byte; nodes that need the same bytes
        get the same object.
        """
        round_cache = _RoundPayloads(self, weights, version=version, server_round=server_round)
        return {node: round_cache.get(self.versions.get(node)) for node in nodes}

    def payload(
        self, node: int, weights: torch.Tensor, *, version: int, server_round: int
    ) -> tuple[bytes, int]:
        """(payload of global-model VALUES the node is missing, base version it patches).

        The base version is -1 when the payload is the dense model. Encodes per call (the
        reference for ``payloads``).
        """
        d = weights.numel()
        dense = encode_update(
            weights, dense_size=d, round=server_round, compression=self.compression
        )
        held = self.versions.get(node)
        if held is None or any(v not in self.touched for v in range(held + 1, version + 1)):
            return dense, -1
        if held + 1 == version and version in self.deltas:
            return self.deltas[version], held
        if held + 1 == version and version in self.seeded:
            seed, keep = self.seeded[version]
            mask = seeded_mask(d, keep, seed)
            return encode_update(
                weights[mask],
                dense_size=d,
                round=server_round,
                mask_seed=seed,
                encoding=wire_encoding(self.codec, sparse=True),
                compression=self.compression,
            ), held
        union = torch.zeros(d, dtype=torch.bool)
        for v in range(held + 1, version + 1):
            union |= self.touched[v]
        support = torch.nonzero(union).flatten()
        sparse = encode_update(
            weights[support],
            dense_size=d,
            round=server_round,
            indices=support,
            encoding="auto",  # a data-dependent union: no seed, smallest explicit support
            compression=self.compression,
        )
        return (sparse, held) if len(sparse) < len(dense) else (dense, -1)


class _RoundPayloads:
    """One round's downlink payloads by the version a node holds, encoded on first use."""

    def __init__(
        self, cache: DownlinkCache, weights: torch.Tensor, *, version: int, server_round: int
    ) -> None:
        self.cache, self.weights = cache, weights
        self.version, self.server_round = version, server_round
        self._dense: bytes | None = None
        self._by_base: dict[int | None, tuple[bytes, int]] = {}

    def dense(self) -> bytes:
        """The dense model, encoded once a round."""
        if self._dense is None:
            self._dense = encode_update(
                self.weights,
                dense_size=self.weights.numel(),
                round=self.server_round,
                compression=self.cache.compression,
            )
        return self._dense

    def get(self, held: int | None) -> tuple[bytes, int]:
        """(payload, base version) for a node holding version ``held`` (None: unknown)."""
        if held not in self._by_base:
            self._by_base[held] = self._encode(held)
        return self._by_base[held]

    def _encode(self, held: int | None) -> tuple[bytes, int]:
        cache, weights, version = self.cache, self.weights, self.version
        d = weights.numel()
        if held is None or any(v not in cache.touched for v in range(held + 1, version + 1)):
            return self.dense(), -1
        if held + 1 == version and version in cache.deltas:
            return cache.deltas[version], held
        if held + 1 == version and version in cache.seeded:
            seed, keep = cache.seeded[version]
            mask = seeded_mask(d, keep, seed)
            return encode_update(
                weights[mask],
                dense_size=d,
                round=self.server_round,
                mask_seed=seed,
                encoding=wire_encoding(cache.codec, sparse=True),
                compression=cache.compression,
            ), held
        union = torch.zeros(d, dtype=torch.bool)
        for v in range(held + 1, version + 1):
            union |= cache.touched[v]
        support = torch.nonzero(union).flatten()
        sparse = encode_update(
            weights[support],
            dense_size=d,
            round=self.server_round,
            indices=support,
            encoding="auto",  # a data-dependent union: no seed, smallest explicit support
            compression=cache.compression,
        )
        dense = self.dense()
        return (sparse, held) if len(sparse) < len(dense) else (dense, -1)
