"""Secure aggregation end to end, server and clients as plain state machines: the exact sum,
dropouts between stages, what the server sees, too few survivors, malformed payloads, bytes."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats

from fedsparse.client.secagg import SecAggClient
from fedsparse.common.aggregation.secure import (
    RingParams,
    choose_ring,
    encode,
    pack_ring,
    ring_sum,
    unpack_ring,
)
from fedsparse.common.wire.secagg import SecAggError, payload_bytes
from fedsparse.server.secagg import SecAggDropoutError, SecAggServer

IDS = [101, 202, 303, 404, 505]
K = 1000


def params(sigma: float = 1.0) -> RingParams:
    return choose_ring(clip=1.0, sigma=sigma, clients=5, threshold=3, kept=K)


def values(nid: int) -> torch.Tensor:
    v = torch.randn(K, generator=torch.Generator().manual_seed(nid), dtype=torch.float64)
    return v * (0.9 / float(v.norm()))


def noise_gen(nid: int) -> torch.Generator:
    return torch.Generator().manual_seed(7 * nid)


class Round:
    """A server and five clients; ``drop_*`` name the nodes that stop answering there."""

    def __init__(self, p: RingParams, inputs: dict[int, torch.Tensor] | None = None) -> None:
        self.p = p
        self.server = SecAggServer(p, IDS)
        self.clients = {nid: SecAggClient(nid, p) for nid in IDS}
        self.inputs = inputs or {nid: values(nid) for nid in IDS}
        self.masked: dict[int, dict[str, Any]] = {}

    def keys(self, drop: Collection[int] = ()) -> None:
        s = self.server
        s.receive_setup({n: self.clients[n].handle(m) for n, m in s.setup_messages().items()})
        msgs = s.share_keys_messages()
        s.receive_share_keys(
            {n: self.clients[n].handle(m) for n, m in msgs.items() if n not in drop}
        )

    def collect(self, drop: Collection[int] = ()) -> None:
        msgs = self.server.collect_messages()
        self.masked = {
            n: self.clients[n].handle(m, self.inputs[n], noise_gen(n))
            for n, m in msgs.items()
            if n not in drop
        }
        self.server.receive_collect(self.masked)

    def unmask(self, drop: Collection[int] = ()) -> torch.Tensor:
        msgs = self.server.unmask_messages()
        return self.server.receive_unmask(
            {n: self.clients[n].handle(m) for n, m in msgs.items() if n not in drop}
        )

    def expected(self, nodes: Collection[int]) -> torch.Tensor:
        """The plain sum of the nodes' quantized, noised ring inputs."""
        inputs = [encode(self.inputs[n], self.p, noise_gen(n)) for n in sorted(nodes)]
        return ring_sum(inputs, self.p.bits)


@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_the_unmasked_sum_is_the_sum_of_the_quantized_inputs(sigma: float) -> None:
    r = Round(params(sigma))
    r.keys()
    r.collect()
    total = r.unmask()
    assert torch.equal(total, r.expected(IDS))
    assert r.server.survivors == IDS
    decoded = r.server.decode(total)
    truth = sum(r.inputs.values())
    assert isinstance(truth, torch.Tensor)
    tolerance = 6 * (r.p.share_std * 5**0.5 + 5**0.5) / r.p.scale
    assert float((decoded - truth).abs().max()) < tolerance
    assert float((decoded - truth).abs().max()) > 0  # rounded (and noised): not the floats


def test_dropouts_after_key_sharing_and_after_masking_leave_the_survivors_sum_exact() -> None:
    r = Round(params())
    r.keys()
    r.collect(drop={202})  # shared its keys, never sent its vector: its pair masks come off
    assert r.server.survivors == [101, 303, 404, 505]
    unmask = r.server.unmask_messages()
    assert all(m["dead_nids"] == [202] for m in unmask.values())
    assert all(not set(m["active_nids"]) & set(m["dead_nids"]) for m in unmask.values())
    total = r.server.receive_unmask(
        {n: r.clients[n].handle(m) for n, m in unmask.items() if n != 404}
    )  # 404 sent its vector, then went silent: its seed is rebuilt from the others' shares
    assert torch.equal(total, r.expected([101, 303, 404, 505]))


def test_a_dropout_before_key_sharing_is_left_out_of_every_mask() -> None:
    r = Round(params())
    r.keys(drop={505})
    assert all(505 not in m["srcs"] for m in r.server.collect_messages().values())
    r.collect()
    assert all(m["dead_nids"] == [] for m in r.server.unmask_messages().values())
    assert torch.equal(r.unmask(), r.expected([101, 202, 303, 404]))


def _uniform_pvalues(data: bytes, p: RingParams) -> tuple[float, float]:
    v = unpack_ring(data, p.kept, p.bits).numpy().astype(np.float64)
    top = (v // 2 ** (p.bits - 4)).astype(np.int64)  # the ring's top 4 bits: 16 bins
    chi = stats.chisquare(np.bincount(top, minlength=16)).pvalue
    ks = stats.kstest(v / p.modulus, "uniform").pvalue
    return float(chi), float(ks)


def test_each_masked_vector_looks_uniform_to_the_server() -> None:
    p = params(sigma=0.0)
    # the most structured input there is: every client sends the same tiny vector
    same = torch.zeros(K, dtype=torch.float64)
    same[:10] = 0.01
    r = Round(p, {nid: same for nid in IDS})
    r.keys()
    r.collect()
    # the keys and self-mask seeds come from OS entropy: 10 p-values per run, each failing
    # with probability 1e-6 when the vectors are uniform
    for reply in r.masked.values():
        chi, ks = _uniform_pvalues(reply["masked_params"], p)
        assert chi > 1e-6 and ks > 1e-6
    # the control: the same vector unmasked is nowhere near uniform
    plain = encode(same, p, noise_gen(0))
    chi, ks = _uniform_pvalues(pack_ring(plain, p.bits), p)
    assert chi < 1e-10 and ks < 1e-10
    assert torch.equal(r.unmask(), r.expected(IDS))


def test_fewer_survivors_than_the_threshold_is_a_clear_error() -> None:
    r = Round(params())
    r.keys()
    with pytest.raises(SecAggDropoutError, match="2 of 5 nodes remain, fewer than the threshold 3"):
        r.collect(drop={101, 202, 303})
    r = Round(params())
    r.keys()
    r.collect(drop={101})
    with pytest.raises(SecAggDropoutError, match="stage 'unmask'.*fewer than the threshold 3"):
        r.unmask(drop={202, 303})
    r = Round(params())
    s = r.server
    s.setup_messages()
    with pytest.raises(SecAggDropoutError, match="stage 'setup'"):
        s.receive_setup({101: r.clients[101].handle(s.setup_messages()[101])})


def test_a_malformed_masked_vector_is_named() -> None:
    r = Round(params())
    r.keys()
    msgs = r.server.collect_messages()
    replies = {n: r.clients[n].handle(m, r.inputs[n], noise_gen(n)) for n, m in msgs.items()}
    short = dict(replies)
    short[303] = {"masked_params": replies[303]["masked_params"][:-1]}
    with pytest.raises(SecAggError, match="'masked_params' of node 303: expected 3000 bytes"):
        r.server.receive_collect(short)
    wrong = dict(replies)
    wrong[303] = {"masked_params": [1, 2, 3]}
    with pytest.raises(
        SecAggError, match="field 'masked_params' must be bytes, got a list of int"
    ) as err:
        r.server.receive_collect(wrong)
    assert err.value.node == 303
    # nothing changed: the stage runs again without the broken reply, 303 now a dropout
    r.server.receive_collect({n: reply for n, reply in replies.items() if n != 303})
    total = r.server.receive_unmask(
        {n: r.clients[n].handle(m) for n, m in r.server.unmask_messages().items()}
    )
    assert torch.equal(total, r.expected([101, 202, 404, 505]))
    up = r.server.bytes["collect_masked_vectors"]["up"]
    assert up == 4 * (K * r.p.element_bytes + len("masked_params"))  # accepted replies only


@pytest.mark.parametrize(
    ("stage", "change", "message"),
    [
        ("share_keys", {"dsts": ["x"]}, "field 'dsts' must be list of int, got a list of str"),
        ("share_keys", {"ctxts": []}, "field 'ctxts' must pair with 'dsts'"),
        ("share_keys", {"dsts": None}, "field 'dsts' must be list of int, got NoneType"),
        ("setup", {"pk1": True}, "field 'pk1' must be bytes, got bool"),
        ("setup", {"extra": 1}, "unexpected field 'extra'"),
    ],
)
def test_a_malformed_reply_is_named(stage: str, change: dict[str, Any], message: str) -> None:
    r = Round(params())
    s = r.server
    replies = {n: r.clients[n].handle(m) for n, m in s.setup_messages().items()}
    if stage == "share_keys":
        s.receive_setup(replies)
        replies = {n: r.clients[n].handle(m) for n, m in s.share_keys_messages().items()}
    replies[404] = {**replies[404], **change}
    receive = s.receive_setup if stage == "setup" else s.receive_share_keys
    with pytest.raises(SecAggError, match=message):
        receive(replies)


def test_the_server_refuses_replies_from_strangers_and_stages_out_of_order() -> None:
    r = Round(params())
    with pytest.raises(SecAggError, match="'share_keys' out of order"):
        r.server.share_keys_messages()
    replies = {n: r.clients[n].handle(m) for n, m in r.server.setup_messages().items()}
    replies[999] = replies[101]
    with pytest.raises(SecAggError, match="node 999, which was not asked"):
        r.server.receive_setup(replies)


def counted(*payloads: dict[int, dict[str, Any]]) -> list[int]:
    return [sum(payload_bytes(p) for p in by_node.values()) for by_node in payloads]


def test_every_stage_message_is_counted_up_and_down() -> None:
    p = params()
    r = Round(p)
    sent: dict[str, list[int]] = {}
    s = r.server
    msgs = s.setup_messages()
    replies = {n: r.clients[n].handle(m) for n, m in msgs.items()}
    s.receive_setup(replies)
    sent["setup"] = [
        sum(map(payload_bytes, msgs.values())),
        sum(map(payload_bytes, replies.values())),
    ]
    msgs = s.share_keys_messages()
    replies = {n: r.clients[n].handle(m) for n, m in msgs.items()}
    s.receive_share_keys(replies)
    sent["share_keys"] = [
        sum(map(payload_bytes, msgs.values())),
        sum(map(payload_bytes, replies.values())),
    ]
    msgs = s.collect_messages()
    replies = {n: r.clients[n].handle(m, r.inputs[n], noise_gen(n)) for n, m in msgs.items()}
    s.receive_collect(replies)
    sent["collect_masked_vectors"] = counted(msgs, replies)
    msgs = s.unmask_messages()
    replies = {n: r.clients[n].handle(m) for n, m in msgs.items()}
    s.receive_unmask(replies)
    sent["unmask"] = [
        sum(map(payload_bytes, msgs.values())),
        sum(map(payload_bytes, replies.values())),
    ]
    assert s.bytes == {stage: {"down": d, "up": u} for stage, (d, u) in sent.items()}
    # the masked vectors: k elements of ceil(b/8) bytes each, per client, plus the key's name
    masked = 5 * (K * p.element_bytes + len("masked_params"))
    assert s.bytes["collect_masked_vectors"]["up"] == masked
    # the setup: 7 ring fields of 8 bytes, their names and the stage, to each of 5 clients
    names = sum(len(f) for f in ("clip", "sigma", "clients", "threshold", "kept", "scale", "bits"))
    assert s.bytes["setup"]["down"] == 5 * (7 * 8 + names + len("stage") + len("setup"))
    assert all(v > 0 for stage in s.bytes.values() for v in stage.values())


def test_payload_bytes_counts_as_a_config_record_does() -> None:
    from flwr.app import ConfigRecord

    payload = {"a": 1, "bb": 2.5, "c": b"xyz", "d": [1, 2, 3], "e": [b"ab", b"c"], "f": True}
    assert payload_bytes(payload) == ConfigRecord(payload).count_bytes()  # type: ignore[arg-type]


def test_what_colluding_peers_recover_still_carries_the_nodes_noise_share() -> None:
    """The worst case: every other node colludes with the server (or is the server's, under
    unauthenticated keys). What comes out is the node's input with its own noise share."""
    p = params(sigma=1.0)
    r = Round(p)
    r.keys()
    r.collect()
    total = r.unmask()
    others = r.expected([n for n in IDS if n != 303])
    recovered = (total - others) & (p.modulus - 1)
    assert torch.equal(recovered, encode(r.inputs[303], p, noise_gen(303)))
    error = r.server.decode(recovered) - r.inputs[303]
    assert float(error.std()) == pytest.approx(p.share_std / p.scale, rel=0.1)
