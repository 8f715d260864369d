"""``max_payload_bytes``: the size bound checked before a reply's payload is parsed."""

import pytest
import torch

from fedsparse.common.masks import keep_count, sample_mask
from fedsparse.common.payload import encode_update
from fedsparse.server.validation import accepted_encodings, max_payload_bytes

D = 5_000
SEED = 12345


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "int8"])
@pytest.mark.parametrize("encoding", ["seeded", "coo", "delta", "bitmap", "dense"])
def test_every_valid_payload_fits_and_the_bound_is_tight(encoding, dtype, compression) -> None:
    keep = D if encoding == "dense" else keep_count(D, rate=0.7)
    mask = sample_mask(D, keep=keep, seed=SEED)
    values = torch.randn(keep, generator=torch.Generator().manual_seed(0))
    payload = encode_update(
        values,
        dense_size=D,
        round=7,
        mask_seed=SEED if encoding == "seeded" else None,
        indices=None if encoding in ("seeded", "dense") else torch.nonzero(mask).flatten(),
        encoding=encoding,
        value_dtype=dtype,
        compression=compression,
    )
    bound = max_payload_bytes(
        d=D,
        server_round=7,
        keep=keep,
        expected_seed=SEED if encoding == "seeded" else None,
        encodings=(encoding,),
        value_dtype=dtype,
        compression=compression,
    )
    assert len(payload) <= bound
    if compression == "none" and encoding != "delta":  # exact up to the compression field
        assert bound - len(payload) <= 2


def test_auto_takes_the_largest_encodings_bound() -> None:
    keep = keep_count(D, rate=0.5)
    kwargs = dict(d=D, server_round=1, keep=keep, expected_seed=SEED)
    kwargs |= dict(value_dtype="fp32", compression="none")
    each = {e: max_payload_bytes(encodings=(e,), **kwargs) for e in ("seeded", "coo", "delta")}
    both = max_payload_bytes(encodings=accepted_encodings("auto", sparse=True), **kwargs)
    assert both == max(each.values()) == each["delta"]  # 9 bytes per varint at worst
    assert each["seeded"] < each["coo"]
