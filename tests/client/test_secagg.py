"""The client's secure-aggregation checks: the ring it accepts (its own policy, not the
server's), its own keys, the stage order, the threshold at every stage, one masked input per
round, fresh keys and seeds, Shamir shares below the threshold, and the validation edges."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes

from fedsparse.client.secagg import SecAggClient, SecAggInputError
from fedsparse.common.aggregation.secure import RingParams, choose_ring
from fedsparse.common.wire.secagg import MAX_FIELD_BYTES, RING_FIELDS, SecAggError

IDS = [1, 2, 3, 4, 5]
K = 64
ROUND = 7
NONCE = b"n" * 16
BIND = {"round_id": ROUND, "nonce": NONCE}


def params() -> RingParams:
    return choose_ring(clip=1.0, sigma=1.0, clients=5, threshold=3, kept=K)


def client(nid: int, p: RingParams | None = None, **policy: Any) -> SecAggClient:
    return SecAggClient(nid, p or params(), min_noise_multiplier=0.5, **policy)


def setup_payload(p: RingParams, round_id: int = ROUND, nonce: bytes = NONCE) -> dict[str, Any]:
    ring = {f: getattr(p, f) for f in RING_FIELDS}
    return {"stage": "setup", **ring, "round_id": round_id, "nonce": nonce}


def keyed(
    round_id: int = ROUND, clients: dict[int, SecAggClient] | None = None
) -> tuple[dict[int, SecAggClient], dict[str, Any]]:
    """Five clients past setup, and the share-keys payload the server would send them."""
    p = params()
    clients = clients or {n: client(n) for n in IDS}
    keys = {n: c.setup(setup_payload(p, round_id)) for n, c in clients.items()}
    payload = {
        "stage": "share_keys",
        "nids": IDS,
        "pk1": [keys[n]["pk1"] for n in IDS],
        "pk2": [keys[n]["pk2"] for n in IDS],
        "round_id": round_id,
        "nonce": NONCE,
    }
    return clients, payload


def collect_payload(shares: dict[int, dict[str, Any]], n: int, round_id: int = ROUND) -> dict:
    srcs = [m for m in IDS if m != n]
    ctxts = [shares[m]["ctxts"][shares[m]["dsts"].index(n)] for m in srcs]
    return {
        "stage": "collect_masked_vectors",
        "srcs": srcs,
        "ctxts": ctxts,
        "round_id": round_id,
        "nonce": NONCE,
    }


def collected(
    round_id: int = ROUND, clients: dict[int, SecAggClient] | None = None
) -> dict[int, SecAggClient]:
    """Five clients past the collection, every one masking with every other."""
    clients, payload = keyed(round_id, clients)
    shares = {n: c.share_keys({**payload}) for n, c in clients.items()}
    for n, c in clients.items():
        reply = c.collect(collect_payload(shares, n, round_id), torch.zeros(K))
        assert (reply["round_id"], reply["nonce"]) == (round_id, NONCE)  # names its round
    return clients


def unmask_payload(round_id: int = ROUND, **change: Any) -> dict[str, Any]:
    return {
        "stage": "unmask",
        "active_nids": IDS,
        "dead_nids": [],
        "round_id": round_id,
        "nonce": NONCE,
        **change,
    }


def test_ring_parameters_other_than_the_nodes_own_are_refused_by_name() -> None:
    p = params()
    c = client(1)
    for field, value in [("clip", 2.0), ("bits", p.bits + 1), ("threshold", 4)]:
        payload = {**setup_payload(p), field: value}
        with pytest.raises(SecAggError, match=f"field '{field}' is .*run config says"):
            c.setup(payload)
    assert set(c.setup(setup_payload(p))) == {"pk1", "pk2", "seeded_noise"}


def test_the_client_checks_the_ring_itself_against_its_own_policy() -> None:
    # a9: a threshold the server would refuse cannot even be written down
    with pytest.raises(ValueError, match="threshold must satisfy"):
        dataclasses.replace(params(), threshold=1)
    with pytest.raises(SecAggError, match="sigma must be positive"):
        client(1, choose_ring(clip=1.0, sigma=0.0, clients=5, threshold=3, kept=K))
    big = choose_ring(clip=1.0, sigma=1.0, clients=1000, threshold=501, kept=K)
    with pytest.raises(SecAggError, match="worst-case noise multiplier .* below .* 0.5"):
        client(1, big)
    with pytest.raises(SecAggError, match="scale is"):
        client(1, dataclasses.replace(params(), scale=params().scale * 2))
    with pytest.raises(SecAggError, match="bits is"):
        client(1, dataclasses.replace(params(), bits=params().bits + 3))
    # the node's own collusion bound: n=5 then needs t >= 4
    with pytest.raises(SecAggError, match="colluders is 0, this node requires at least 1"):
        client(1, colluders=1)
    four = choose_ring(clip=1.0, sigma=1.0, clients=5, threshold=4, kept=K, colluders=1)
    assert SecAggClient(1, four, min_noise_multiplier=0.4, colluders=1).params == four


def test_noise_is_fresh_unless_a_simulation_names_a_seed() -> None:
    with pytest.raises(SecAggError, match="noise='seeded' \\(simulation\\) needs a noise_seed"):
        client(1, noise="seeded")
    with pytest.raises(SecAggError, match="'fresh' takes none"):
        client(1, noise_seed=3)
    with pytest.raises(SecAggError, match="noise must be 'fresh' or 'seeded'"):
        client(1, noise="os")
    assert client(1).setup(setup_payload(params()))["seeded_noise"] == 0
    seeded = client(1, noise="seeded", noise_seed=3)
    assert seeded.setup(setup_payload(params()))["seeded_noise"] == 1


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
    with pytest.raises(SecAggError, match="'round_id'/'nonce' is not this round's"):
        c.share_keys({**payload, "nonce": b"m" * 16})
    reply = c.share_keys(payload)
    assert reply["dsts"] == [2, 3, 4, 5] and len(reply["ctxts"]) == 4
    assert len(reply["seed_commit"]) == 32


def test_the_validation_edges_are_protocol_errors() -> None:
    clients, payload = keyed()
    c = clients[1]
    for bad in (2**64, -1):  # node ids are unsigned 64-bit
        with pytest.raises(SecAggError, match=f"field 'nids' holds {bad}, not an unsigned"):
            c.share_keys({**payload, "nids": [1, 2, 3, 4, bad]})
    with pytest.raises(SecAggError, match="node id 18446744073709551616 is not"):
        client(2**64)
    # a peer's pk1 that does not parse is refused now, not after encoding in collect
    junk = {**payload, "pk1": [*payload["pk1"][:2], b"garbage", *payload["pk1"][3:]]}
    with pytest.raises(SecAggError, match="'pk1'/'pk2' of node 3 is not a usable key"):
        c.share_keys(junk)
    other_curve = public_key_to_bytes(generate_key_pairs()[1])  # a valid key, but not 3's
    assert other_curve not in payload["pk1"]
    huge = {**payload, "pk2": [*payload["pk2"][:4], b"x" * (MAX_FIELD_BYTES + 1)]}
    with pytest.raises(SecAggError, match=f"field 'pk2' holds {MAX_FIELD_BYTES + 1} bytes"):
        c.share_keys(huge)
    with pytest.raises(SecAggError, match="field 'nonce' has 4 bytes, fewer than 16"):
        client(2).setup(setup_payload(params(), nonce=b"abcd"))


def test_non_finite_values_are_a_local_refusal_that_changes_nothing() -> None:
    clients, payload = keyed()
    shares = {n: c.share_keys({**payload}) for n, c in clients.items()}
    c = clients[1]
    bad = torch.zeros(K)
    bad[3] = float("nan")
    with pytest.raises(SecAggInputError, match="not finite") as err:
        c.collect(collect_payload(shares, 1), bad)
    assert not isinstance(err.value, SecAggError)  # not a protocol message for the server
    with pytest.raises(SecAggInputError, match=f"expected {K} kept values"):
        c.collect(collect_payload(shares, 1), torch.zeros(K + 1))
    assert c.released_rounds == frozenset()
    reply = c.collect(collect_payload(shares, 1), torch.zeros(K))
    assert len(reply["masked_params"]) == params().input_bytes
    assert c.released_rounds == {ROUND}


def test_stages_run_in_order_and_unmask_answers_once() -> None:
    clients = collected()
    c = clients[1]
    with pytest.raises(SecAggError, match="expected stage 'unmask' next"):
        c.collect(
            {"stage": "collect_masked_vectors", "srcs": [], "ctxts": [], **BIND}, torch.zeros(K)
        )
    unmask = unmask_payload(active_nids=[1, 2, 3, 4], dead_nids=[5])
    with pytest.raises(SecAggError, match="field 'dead_nids' names live node 4"):
        c.unmask({**unmask, "dead_nids": [4, 5]})
    with pytest.raises(SecAggError, match="'active_nids' leaves out this \\(live\\) node"):
        c.unmask({**unmask, "active_nids": [2, 3, 4]})
    with pytest.raises(SecAggError, match="has 2 nodes, fewer than the threshold 3"):
        c.unmask({**unmask, "active_nids": [1, 2]})
    with pytest.raises(SecAggError, match="node 8 was not in this node's sum"):
        c.unmask({**unmask, "dead_nids": [8]})
    with pytest.raises(SecAggError, match="is not this round's \\(round 7\\)"):
        c.unmask({**unmask, "round_id": 8})
    reply = c.unmask(unmask)
    assert reply["nids"] == [1, 2, 3, 4, 5] and len(reply["shares"]) == 5
    # a second request (say, naming 4 dead, to get its key share too) is refused
    with pytest.raises(SecAggError, match="expected stage 'setup' next"):
        c.unmask({**unmask, "active_nids": [1, 2, 3], "dead_nids": [4, 5]})


def test_a_round_releases_one_masked_input_however_the_server_restarts() -> None:
    """a2: the server restarts a round to collect the same values again with fresh noise."""
    clients = collected()
    c = clients[1]
    for _ in range(2):  # after the unmask, or in the middle of the next attempt
        with pytest.raises(SecAggError, match="round 7 already has this node's masked input"):
            c.setup(setup_payload(params(), ROUND, nonce=os.urandom(16)))
    c.unmask(unmask_payload())
    with pytest.raises(SecAggError, match="round 7 already has this node's masked input"):
        c.setup(setup_payload(params(), ROUND, nonce=os.urandom(16)))
    # restored from the node's state: a new process refuses the round too
    again = client(1, released_rounds=c.released_rounds)
    with pytest.raises(SecAggError, match="round 7 already has"):
        again.setup(setup_payload(params()))
    # a restart before the masked input left is fine, and the next round goes ahead
    fresh = {n: client(n) for n in IDS}
    keyed(ROUND, fresh)
    collected(ROUND, fresh)
    assert all(c.released_rounds == {ROUND} for c in fresh.values())
    collected(ROUND + 1, clients)
    assert clients[1].released_rounds == {ROUND, ROUND + 1}


def test_keys_and_self_seeds_are_fresh_every_round() -> None:
    c = client(1)
    first = c.setup(setup_payload(params()))
    second = c.setup(setup_payload(params()))
    assert first["pk1"] != second["pk1"] and first["pk2"] != second["pk2"]
    seeds = []
    clients = {n: client(n) for n in IDS}
    for round_id in (1, 2):
        collected(round_id, clients)
        seeds.append(clients[1].progress.self_seed)
        assert len(seeds[-1]) == 32
        clients[1].unmask(unmask_payload(round_id))
    assert seeds[0] != seeds[1]


def rebuilds(shares: list[bytes], secret: bytes) -> bool:
    try:
        return combine_shares(shares) == secret
    except ValueError:  # the padding does not check out: nothing rebuilt
        return False


def test_fewer_than_threshold_shares_do_not_rebuild_a_secret() -> None:
    """A client that Shamir-shared below its threshold (the a8 mutant) fails this."""
    clients = collected()
    t = params().threshold
    for owner in IDS:
        held = [c.progress.sk1_shares[owner] for c in clients.values()]
        seeds = [c.progress.seed_shares[owner] for c in clients.values()]
        sk1, seed = clients[owner].progress.sk1, clients[owner].progress.self_seed
        assert rebuilds(held[:t], sk1) and rebuilds(held[-t:], sk1)
        assert rebuilds(seeds[1 : t + 1], seed)
        for i in range(len(IDS) - t + 2):
            assert not rebuilds(held[i : i + t - 1], sk1)
            assert not rebuilds(seeds[i : i + t - 1], seed)


def test_collect_refuses_a_forged_share_and_too_few_nodes() -> None:
    clients, payload = keyed()
    shares = {n: c.share_keys({**payload}) for n, c in clients.items()}
    c = clients[1]
    good = collect_payload(shares, 1)
    ctxts = good["ctxts"]
    swapped = [ctxts[1], ctxts[0], *ctxts[2:]]  # 3's share presented as 2's: wrong key
    with pytest.raises(SecAggError, match="field 'ctxts' from node 2 does not decrypt"):
        c.collect({**good, "ctxts": swapped}, torch.zeros(K))
    with pytest.raises(SecAggError, match="2 nodes remain, fewer than the threshold 3"):
        c.collect({**good, "srcs": [2], "ctxts": ctxts[:1]}, torch.zeros(K))
    with pytest.raises(SecAggError, match="needs the kept values"):
        c.handle(good)
    with pytest.raises(SecAggError, match="'round_id'/'nonce' is not this round's"):
        c.collect({**good, "round_id": ROUND + 1}, torch.zeros(K))
    reply = c.collect(good, torch.zeros(K))
    assert len(reply["masked_params"]) == params().input_bytes


def test_a_nodes_round_in_a_repr_shows_no_secret() -> None:
    """A reviewer's case: ``progress`` is public; a log line or a traceback's repr of it must
    not carry the private keys, the self-mask seed, the pairwise seeds or the shares."""
    clients = collected()
    progress = clients[1].progress
    secrets = [progress.sk1, progress.sk2, progress.self_seed]
    secrets += [*progress.pair_seed_of.values(), *progress.share_key_of.values()]
    secrets += [*progress.seed_shares.values(), *progress.sk1_shares.values()]
    assert all(secrets) and len(secrets) > 3
    shown = repr(progress) + str(clients[1].policy)
    assert not any(repr(secret) in shown or secret.hex() in shown for secret in secrets)
    assert repr(progress.pk1) in shown  # the public ones are shown
