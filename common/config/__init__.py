"""The federated run's configuration (``FederatedConfig``, ``federated.py``) and its key table
(``keys.py``: the names each key accepts, keys added after runs were recorded, keys a resumed
run may change); the public names of both."""

from fedsparse.common.config.federated import METHOD_OPTIONS, FederatedConfig, run_config_fields
from fedsparse.common.config.keys import (
    ADDED_KEYS,
    CODECS,
    NAMED_FIELDS,
    RESUME_MAY_DIFFER,
    TRACKERS,
    CodecName,
    wire_encoding,
    with_added_keys,
)
from fedsparse.common.wire.protocol import MASK_SCOPES, MaskScope

__all__ = [
    "ADDED_KEYS",
    "CODECS",
    "METHOD_OPTIONS",
    "MASK_SCOPES",
    "NAMED_FIELDS",
    "RESUME_MAY_DIFFER",
    "TRACKERS",
    "CodecName",
    "FederatedConfig",
    "MaskScope",
    "run_config_fields",
    "wire_encoding",
    "with_added_keys",
]
