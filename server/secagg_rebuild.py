"""The server's rebuilding of a node's secret from its holders' shares (``server/secagg.py``):
Flower's ``combine_shares`` over the complete graph, ``GF(P)`` interpolation over a sparse
ring (``common/aggregation/shamir.py``), each rebuilt secret checked against what its owner
committed to, and a bad share's sender found by leaving each out in turn."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.supercore.primitives.asymmetric import private_key_to_bytes

from fedsparse.common.aggregation import shamir
from fedsparse.common.wire.secagg import SecAggError
from fedsparse.common.wire.secagg_compact import private_key_of, seed_of

__all__ = ["Share", "rebuild"]

#: One share a holder sent: (its sender, Shamir's x, the share's bytes).
Share = tuple[int, int, bytes]


def _combine(sparse: bool, shares: Sequence[Share], what: str) -> bytes | None:
    """The secret ``shares`` rebuild (a seed, or a PEM private key for ``what == "key"``),
    None when they are not shares of one."""
    if not sparse:
        share_list = [share for _, _, share in shares]
        if len({len(s) for s in share_list}) > 1 or any(len(s) < 20 for s in share_list):
            return None
        try:
            return combine_shares(share_list)
        except ValueError:
            return None
    try:
        element = shamir.combine([(x, shamir.from_bytes(share)) for _, x, share in shares])
        if what == "key":
            return private_key_to_bytes(private_key_of(element))
        return seed_of(element)
    except ValueError:
        return None


def rebuild(
    shares: Sequence[Share],
    owner: int,
    what: str,
    valid: Callable[[int, bytes], bool],
    threshold: int,
    sparse: bool,
) -> bytes:
    """``owner``'s secret (``what``: "self-mask seed" or "key") from its shares, checked by
    ``valid``; ``SecAggError`` naming a bad share's sender when one is found: over the
    complete graph (and from ``t + 1`` shares) the one whose leaving out mends it, over a
    sparse ring from more one off the polynomial most shares lie on (``shamir.outliers``),
    and only if the rest rebuild."""

    def attempt(subset: Sequence[Share]) -> bytes | None:
        secret = _combine(sparse, subset, "key" if what == "key" else "seed")
        return secret if secret is not None and valid(owner, secret) else None

    secret = attempt(shares)
    if secret is not None:
        return secret
    culprit = None
    if sparse and len(shares) > threshold + 1:  # off the polynomial most lie on, if it rebuilds
        points = [(x, shamir.from_bytes(share)) for _, x, share in shares]
        off = shamir.outliers(points, threshold)
        on = [s for i, s in enumerate(shares) if off is not None and i not in off]
        if off and attempt(on) is not None:
            culprit = shares[off[0]][0]
    elif len(shares) > threshold:  # leave each reply out: which one breaks it? (t + 1
        # shares of a sparse ring: two colluding holders could put it on an honest one)
        for sender, _, _ in shares:
            if attempt([s for s in shares if s[0] != sender]) is not None:
                culprit = sender
                break
    who = f"node {culprit}'s share is bad" if culprit is not None else "no culprit found"
    raise SecAggError(
        f"secure aggregation: the shares of node {owner} do not rebuild its {what} ({who})",
        node=culprit,
    )
