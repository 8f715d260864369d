"""Local DP-SGD training: the settings (``configs``), the one-epoch loop and evaluation
(``local``), the centralized driver (``centralized``). The package re-exports their names,
and ``ACCOUNTANTS``, ``gip_privacy`` and ``round_mask`` from their own modules.
"""

from fedsparse.common.dp.accounting import ACCOUNTANTS
from fedsparse.common.methods.gip import gip_privacy
from fedsparse.common.methods.selection import round_mask
from fedsparse.common.training.centralized import pretrain_public, train_centralized
from fedsparse.common.training.configs import (
    DEVICES,
    DeviceName,
    PrivacyConfig,
    SparsityConfig,
    TrainConfig,
    planned_engine,
    resolve_device,
)
from fedsparse.common.training.local import EpochStats, evaluate, make_private, train_one_epoch

__all__ = [
    "ACCOUNTANTS",
    "DEVICES",
    "DeviceName",
    "EpochStats",
    "PrivacyConfig",
    "SparsityConfig",
    "TrainConfig",
    "evaluate",
    "gip_privacy",
    "make_private",
    "planned_engine",
    "resolve_device",
    "round_mask",
    "pretrain_public",
    "train_centralized",
    "train_one_epoch",
]
