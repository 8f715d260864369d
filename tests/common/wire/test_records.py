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


def test_a_federated_summary_carries_the_shared_header_and_the_run_s_sigma_range() -> None:
    from fedsparse.common.wire.run_log import (
        SCHEMA,
        SHARED_SUMMARY_KEYS,
        config_hash,
        shared_key_problems,
        software_versions,
    )

    config = {"num-rounds": 3, "target-epsilon": 2.0, "method": "rs"}
    logs = [
        dataclasses.replace(_round(1, up=D, answering=2), noise_multiplier_min=1.25,
                            noise_multiplier_max=1.5),
        _round(2, up=D, answering=0),  # no accepted update: no sigma (null)
        dataclasses.replace(_round(3, up=D, answering=2), noise_multiplier_min=1.1,
                            noise_multiplier_max=1.3),
    ]  # fmt: skip
    summary = RunSummary.from_rounds(
        logs, parameters=D, delta=1e-5, config=config, engine="factored", command="fedsparse x"
    )
    data = json.loads(summary.to_json())
    assert shared_key_problems(data) == []
    assert set(SHARED_SUMMARY_KEYS) <= set(data)
    assert (data["kind"], data["schema"], data["engine"]) == ("federated", SCHEMA, "factored")
    assert data["command"] == "fedsparse x"
    assert data["config_hash"] == config_hash(config) and len(data["config_hash"]) == 16
    assert data["versions"] == software_versions()
    assert (data["noise_multiplier_min"], data["noise_multiplier_max"]) == (1.1, 1.5)
    assert json.loads(logs[1].to_json())["noise_multiplier_min"] is None
    assert RunSummary.from_json(data) == summary


def test_summaries_and_lines_older_than_the_header_still_parse_as_schema_1() -> None:
    summary = RunSummary.from_rounds([_round(1, up=D, answering=1)], parameters=D, delta=1e-5,
                                     config={"a": 1})  # fmt: skip
    header = ("kind", "schema", "command", "config_hash", "engine", "noise_multiplier_min",
              "noise_multiplier_max")  # fmt: skip
    older = {k: v for k, v in summary.to_dict().items() if k not in header}
    old = RunSummary.from_json(older)
    assert (old.kind, old.schema, old.config_hash, old.engine) == ("federated", 1, None, None)
    assert old.noise_multiplier_min is None and old.noise_multiplier_max is None
    line = json.loads(_round(1, up=D, answering=1).to_json())
    del line["noise_multiplier_min"], line["noise_multiplier_max"]
    assert RoundLog.from_json(line).noise_multiplier_max is None


def test_the_config_hash_is_canonical_and_the_command_line_is_shell_quoted() -> None:
    from fedsparse.common.wire.run_log import command_line, config_hash

    a = config_hash({"x": 1, "y": {"b": 2.0, "a": None}})
    assert a == config_hash({"y": {"a": None, "b": 2.0}, "x": 1})  # key order does not count
    assert a != config_hash({"x": 2, "y": {"b": 2.0, "a": None}})
    assert len(a) == 16 and int(a, 16) >= 0
    # where the run writes is no setting: the same run in another directory hashes alike
    assert config_hash({"x": 1, "out-dir": "runs/a"}) == config_hash({"x": 1, "out-dir": "b"})
    line = command_line(["/opt/venv/bin/fedsparse", "train", "--out", "my runs/a b"])
    assert line == "fedsparse train --out 'my runs/a b'"
    assert command_line([]) == ""


def test_sigma_is_null_where_no_update_carried_one_or_the_mechanism_is_not_private() -> None:
    from fedsparse.common.wire.run_log import noise_range

    assert noise_range([1.5, 0.9, 1.2], private=True) == (0.9, 1.5)
    assert noise_range([], private=True) == (None, None)
    assert noise_range([0.0, 0.0], private=False) == (None, None)


def test_a_launcher_records_the_command_line_in_the_written_summary(tmp_path) -> None:
    from fedsparse.common.wire.run_log import record_command

    summary = RunSummary.from_rounds([_round(1, up=D, answering=1)], parameters=D, delta=1e-5,
                                     config={})  # fmt: skip
    path = tmp_path / "summary.json"
    path.write_text(summary.to_json())
    assert record_command(path, summary, None) is summary
    assert json.loads(path.read_text())["command"] is None
    stamped = record_command(path, summary, "fedsparse simulate --rounds 2")
    assert stamped.command == "fedsparse simulate --rounds 2"
    assert RunSummary.from_json(path.read_text()) == stamped


def test_downlink_bits_sit_beside_uplink_and_old_records_derive_them() -> None:
    """``32 * downlink payload / dense downlink`` (4 d per selected client), per round and per
    run; a line or summary written before the field parses and gets it from its bytes."""
    entry = dataclasses.replace(_round(1, up=D, answering=2), downlink_payload_bytes=D // 2)
    assert entry.downlink_bits_per_param == pytest.approx(32 * (D // 2) / (8 * D))
    assert "downlink_bits_per_param" in per_round_fields()
    assert "downlink_bits_per_param" in summary_metrics()
    line = json.loads(entry.to_json())
    del line["downlink_bits_per_param"]
    assert RoundLog.from_json(line).downlink_bits_per_param == pytest.approx(2.0)
    logs = [entry, _round(2, up=D, answering=2)]  # dense fp32 down: 32 bits
    data = RunSummary.from_rounds(logs, parameters=D, delta=1e-5, config={}).to_dict()
    assert data["downlink_bits_per_param"] == pytest.approx(32 * (D // 2 + 8 * D) / (16 * D))
    del data["downlink_bits_per_param"]
    assert RunSummary.from_json(data).downlink_bits_per_param == pytest.approx(17.0)


def test_a_round_names_its_runners_from_the_vocabulary_and_older_lines_have_none() -> None:
    line = json.loads(_round(1, up=D, answering=3).to_json())
    assert line["runners"] is None  # a grid that does not say
    line["runners"] = {"vectorised": 2, "client-round": 1}
    assert RoundLog.from_json(line).runners == {"vectorised": 2, "client-round": 1}
    del line["runners"]
    assert RoundLog.from_json(line).runners is None
    with pytest.raises(ValueError, match="runners=.*'fast'.*vectorised, client-round"):
        dataclasses.replace(_round(1, up=D, answering=1), runners={"fast": 1})
