"""Run records: bits per parameter are derived from the byte fields, old records still parse."""

import dataclasses
import json
import math

import pytest

from fedsparse.common.wire.run_log import (
    BITS_PER_PARAM_REFERENCES,
    RoundLog,
    RunSummary,
    per_round_fields,
    summary_metrics,
    uplink_bits_per_param,
)

D = 1000  # model parameters


def _round(n: int, *, up: int, answering: int) -> RoundLog:
    return RoundLog(
        round=n, num_clients=answering, num_replies=answering, num_rejected=0, rate=0.9,
        keep=D // 10, keep_fraction=0.1, test_accuracy=0.5, test_loss=1.0, epsilon_max=1.0,
        epsilon_median=1.0, train_loss=1.0, uplink_payload_bytes=up, uplink_message_bytes=up + 99,
        downlink_payload_bytes=4 * D * answering, downlink_message_bytes=4 * D * answering + 99,
        dense_uplink_bytes=4 * D * answering, dense_downlink_bytes=4 * D * answering,
        wall_seconds=1.0, started_at=0.0, ended_at=1.0, rejected=[],
    )  # fmt: skip


def test_dense_fp32_is_32_bits_and_int8_values_at_r09_is_08() -> None:
    """``32 * payload / dense``: fp32 everything = 32; int8 values of 10% = 0.8 bits/param."""
    assert _round(1, up=4 * D * 3, answering=3).uplink_bits_per_param == 32.0
    assert _round(1, up=(D // 10) * 3, answering=3).uplink_bits_per_param == pytest.approx(0.8)
    # A header of h bytes per client adds 8 h / d bits.
    assert _round(1, up=(D // 10 + 25) * 2, answering=2).uplink_bits_per_param == pytest.approx(
        0.8 + 8 * 25 / D
    )
    assert math.isnan(_round(1, up=0, answering=0).uplink_bits_per_param)


def test_summary_bits_weight_rounds_by_their_client_count() -> None:
    """The run's value is total bits over total client-parameters, not a mean of rounds."""
    logs = [_round(1, up=4 * D * 1, answering=1), _round(2, up=(D // 10) * 3, answering=3)]
    summary = RunSummary.from_rounds(logs, parameters=D, delta=1e-5, config={})
    # 4300 payload bytes over 4 client-rounds of D parameters: 8 * 4300 / 4000 = 8.6 bits.
    assert summary.uplink_bits_per_param == pytest.approx(8.6)
    assert summary.uplink_bits_per_param != pytest.approx((32 + 0.8) / 2)


def test_records_without_the_field_get_it_derived_and_a_given_value_is_not_trusted() -> None:
    """Lines written before the field parse; the value always follows the byte fields."""
    line = json.loads(_round(1, up=D, answering=1).to_json())
    assert line["uplink_bits_per_param"] == pytest.approx(8.0)
    del line["uplink_bits_per_param"]
    assert RoundLog.from_json(line).uplink_bits_per_param == pytest.approx(8.0)
    line["uplink_bits_per_param"] = 0.001
    assert RoundLog.from_json(line).uplink_bits_per_param == pytest.approx(8.0)

    summary = RunSummary.from_rounds([_round(1, up=D, answering=1)], parameters=D, delta=1e-5,
                                     config={})  # fmt: skip
    data = summary.to_dict()
    del data["uplink_bits_per_param"]
    assert RunSummary.from_json(data).uplink_bits_per_param == pytest.approx(8.0)


def test_sweeps_keep_the_field_per_round_and_per_run() -> None:
    assert "uplink_bits_per_param" in per_round_fields()
    assert "uplink_bits_per_param" in summary_metrics()
    names = {f.name for f in dataclasses.fields(RoundLog)}
    assert "uplink_bits_per_param" in names


def test_reference_points_are_the_published_ones() -> None:
    assert sorted(BITS_PER_PARAM_REFERENCES.values()) == [1.2, 16.0, 32.0]
    assert uplink_bits_per_param(4, 4) == 32.0


def test_a_summary_records_the_software_and_null_for_figures_that_do_not_apply() -> None:
    import importlib.metadata

    from fedsparse.common.wire.run_log import SOFTWARE, RoundLog, RunSummary

    log = RoundLog(
        round=1,
        num_clients=1,
        num_replies=1,
        num_rejected=0,
        rate=0.0,
        keep=4,
        keep_fraction=1.0,
        test_accuracy=0.5,
        test_loss=1.0,
        epsilon_max=1.0,
        epsilon_median=1.0,
        train_loss=1.0,
        uplink_payload_bytes=16,
        uplink_message_bytes=20,
        downlink_payload_bytes=16,
        downlink_message_bytes=20,
        dense_uplink_bytes=16,
        dense_downlink_bytes=16,
        wall_seconds=1.0,
        started_at=0.0,
        ended_at=1.0,
        rejected=[],
    )
    summary = RunSummary.from_rounds([log], parameters=4, delta=1e-5, config={})
    assert summary.versions == {n: importlib.metadata.version(n) for n in SOFTWARE}
    data = json.loads(summary.to_json())
    assert data["user_epsilon"] is None  # a sample-level run: no user-level figure, not 0
    assert json.loads(log.to_json())["user_epsilon"] is None
    assert RunSummary.from_json(data) == summary
    older = {k: v for k, v in data.items() if k != "versions"} | {"user_epsilon": 0.0}
    assert RunSummary.from_json(older).versions == {}  # summaries written before still read
