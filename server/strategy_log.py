"""What ``SparseFedAvg`` logs of its configuration at the start of a run."""

from __future__ import annotations

from logging import INFO

from flwr.common.logger import log

from fedsparse.common.aggregation.norm_bounds import HonestClientBound, NormBound
from fedsparse.common.config import FederatedConfig

__all__ = ["log_configuration"]


def log_configuration(
    cfg: FederatedConfig, *, d: int, norm_bound: NormBound, caps: HonestClientBound | None
) -> None:
    """Logs the schedule, codec, aggregation and norm bound (``caps``: ``dp-norm-bound``'s)."""
    log(
        INFO,
        "SparseFedAvg: d=%d, schedule=%s to r*=%.3f over %d rounds, mask-scope=%s, codec=%s",
        d,
        cfg.schedule,
        cfg.final_rate,
        cfg.num_rounds,
        cfg.mask_scope,
        cfg.codec,
    )
    log(
        INFO,
        "SparseFedAvg: weighting=%s, aggregator=%s (trim-fraction %g), %s (%s), "
        "max-failed-rounds=%d",
        cfg.weighting,
        cfg.aggregator,
        cfg.trim_fraction,
        norm_bound,
        cfg.norm_action,
        cfg.max_failed_rounds,
    )
    if caps is not None:
        log(
            INFO,
            "SparseFedAvg: dp-norm-bound=auto: lr %g, momentum %g, max-grad-norm %g, "
            "sigma <= %.4g, <= %d steps a round (batch-size %d, <= %d examples a client), "
            "value-dtype %s: %.4g at keep=d",
            caps.lr,
            caps.momentum,
            caps.max_grad_norm,
            caps.noise_multiplier,
            caps.max_steps,
            caps.batch_size,
            caps.max_examples,
            caps.value_dtype,
            caps.bound(d),
        )
