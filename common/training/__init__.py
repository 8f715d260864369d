"""Local DP-SGD training (``local``): configs, the one-epoch loop, evaluation, the
centralized driver. The package re-exports ``local``'s names.
"""

from fedsparse.common.training.local import (
    ACCOUNTANTS,
    DEVICES,
    DeviceName,
    EpochStats,
    PrivacyConfig,
    SparsityConfig,
    TrainConfig,
    evaluate,
    gip_privacy,
    make_private,
    planned_engine,
    pretrain_public,
    resolve_device,
    round_mask,
    train_centralized,
    train_one_epoch,
)

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
