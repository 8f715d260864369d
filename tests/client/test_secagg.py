"""The client's secure-aggregation checks: its own ring parameters, its own keys, the stage
order, the threshold at every stage, and one answer to the unmask stage per round."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from fedsparse.client.secagg import SecAggClient
from fedsparse.common.aggregation.secure import RingParams, choose_ring
from fedsparse.common.wire.secagg import SecAggError

IDS = [1, 2, 3, 4, 5]
K = 64


def params() -> RingParams:
    return choose_ring(clip=1.0, sigma=1.0, clients=5, threshold=3, kept=K)


def setup_payload(p: RingParams) -> dict[str, Any]:
    fields = ("clip", "sigma", "clients", "threshold", "kept", "scale", "bits")
    return {"stage": "setup", **{f: getattr(p, f) for f in fields}}


def keyed() -> tuple[dict[int, SecAggClient], dict[str, Any]]:
    """Five clients past setup, and the share-keys payload the server would send them."""
    p = params()
    clients = {n: SecAggClient(n, p) for n in IDS}
    keys = {n: c.setup(setup_payload(p)) for n, c in clients.items()}
    payload = {
        "stage": "share_keys",
        "nids": IDS,
        "pk1": [keys[n]["pk1"] for n in IDS],
        "pk2": [keys[n]["pk2"] for n in IDS],
    }
    return clients, payload


def collected() -> dict[int, SecAggClient]:
    """Five clients past the collection, every one masking with every other."""
    clients, payload = keyed()
    shares = {n: c.share_keys(payload) for n, c in clients.items()}
    for n, c in clients.items():
        srcs = [m for m in IDS if m != n]
        ctxts = [shares[m]["ctxts"][shares[m]["dsts"].index(n)] for m in srcs]
        c.collect(
            {"stage": "collect_masked_vectors", "srcs": srcs, "ctxts": ctxts},
            torch.zeros(K),
            torch.Generator().manual_seed(n),
        )
    return clients


def test_ring_parameters_other_than_the_nodes_own_are_refused_by_name() -> None:
    p = params()
    client = SecAggClient(1, p)
    for field, value in [("sigma", 0.0), ("bits", p.bits + 1), ("threshold", 4)]:
        payload = setup_payload(dataclasses.replace(p, **{field: value}))
        with pytest.raises(SecAggError, match=f"field '{field}' is .*run config says"):
            client.setup(payload)
    assert set(client.setup(setup_payload(p))) == {"pk1", "pk2"}


def test_share_keys_checks_the_node_list_and_its_own_keys() -> None:
    clients, payload = keyed()
    c = clients[1]
    with pytest.raises(SecAggError, match="field 'nids' has 2 nodes, outside"):
        c.share_keys(
            {**payload, "nids": [1, 2], "pk1": payload["pk1"][:2], "pk2": payload["pk2"][:2]}
        )
    with pytest.raises(SecAggError, match="field 'pk1'/'pk2' alters this node's own keys"):
        c.share_keys({**payload, "pk1": [payload["pk1"][1], *payload["pk1"][1:]]})
    with pytest.raises(SecAggError, match="field 'nids' leaves out this node"):
        c.share_keys({**payload, "nids": [9, 2, 3, 4, 5]})
    with pytest.raises(
        SecAggError, match="field 'nids' must be list of int, got a list of int/str"
    ):
        c.share_keys({**payload, "nids": [1, 2, "3", 4, 5]})
    reply = c.share_keys(payload)
    assert reply["dsts"] == [2, 3, 4, 5] and len(reply["ctxts"]) == 4


def test_stages_run_in_order_and_unmask_answers_once() -> None:
    clients = collected()
    c = clients[1]
    with pytest.raises(SecAggError, match="expected stage 'unmask' next"):
        c.collect(
            {"stage": "collect_masked_vectors", "srcs": [], "ctxts": []},
            torch.zeros(K),
            torch.Generator(),
        )
    unmask = {"stage": "unmask", "active_nids": [1, 2, 3, 4], "dead_nids": [5]}
    with pytest.raises(SecAggError, match="field 'dead_nids' names live node 4"):
        c.unmask({**unmask, "dead_nids": [4, 5]})
    with pytest.raises(SecAggError, match="'active_nids' leaves out this \\(live\\) node"):
        c.unmask({**unmask, "active_nids": [2, 3, 4]})
    with pytest.raises(SecAggError, match="has 2 nodes, fewer than the threshold 3"):
        c.unmask({**unmask, "active_nids": [1, 2]})
    with pytest.raises(SecAggError, match="node 8 was not in this node's sum"):
        c.unmask({**unmask, "dead_nids": [8]})
    reply = c.unmask(unmask)
    assert reply["nids"] == [1, 2, 3, 4, 5] and len(reply["shares"]) == 5
    # a second request (say, naming 4 dead, to get its key share too) is refused
    with pytest.raises(SecAggError, match="expected stage 'setup' next"):
        c.unmask({**unmask, "active_nids": [1, 2, 3], "dead_nids": [4, 5]})


def test_collect_refuses_a_forged_share_and_too_few_nodes() -> None:
    clients, payload = keyed()
    shares = {n: c.share_keys(payload) for n, c in clients.items()}
    c = clients[1]
    srcs = [2, 3, 4, 5]
    ctxts = [shares[m]["ctxts"][shares[m]["dsts"].index(1)] for m in srcs]
    args = (torch.zeros(K), torch.Generator())
    swapped = [ctxts[1], ctxts[0], *ctxts[2:]]  # 3's share presented as 2's: wrong key
    with pytest.raises(SecAggError, match="field 'ctxts' from node 2 does not decrypt"):
        c.collect({"stage": "collect_masked_vectors", "srcs": srcs, "ctxts": swapped}, *args)
    with pytest.raises(SecAggError, match="2 nodes remain, fewer than the threshold 3"):
        c.collect({"stage": "collect_masked_vectors", "srcs": [2], "ctxts": ctxts[:1]}, *args)
    with pytest.raises(SecAggError, match="needs the kept values"):
        c.handle({"stage": "collect_masked_vectors", "srcs": srcs, "ctxts": ctxts})
    reply = c.collect({"stage": "collect_masked_vectors", "srcs": srcs, "ctxts": ctxts}, *args)
    assert len(reply["masked_params"]) == K * params().element_bytes
