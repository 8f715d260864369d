"""The real ServerApp loop and ClientApp, rounds delivered in process (fedsparse InProcessGrid)."""

import json
import math
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message

from fedsparse.client.app import app as client_app
from fedsparse.common.aggregation.sparse import SparseAggregator
from fedsparse.common.config import FederatedConfig
from fedsparse.common.masks import keep_count
from fedsparse.common.wire.payload import decode_update, encode_update, payload_size
from fedsparse.common.wire.protocol import CONFIG_RECORD, METRICS_RECORD, round_seed
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.app import run_federated

D_DIGITS = 38_282


def run(tmp_path: Path, nodes: int = 4, overrides=None, **kwargs) -> list[dict]:
    cfg = FederatedConfig(out_dir=str(tmp_path), **kwargs)
    grid = InProcessGrid(
        client_app, num_nodes=nodes, run_config=cfg.to_run_config(), overrides=overrides
    )
    run_federated(grid, cfg)
    return [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]


def test_three_rounds_learn_within_budget_with_analytic_bytes(tmp_path: Path) -> None:
    rounds = run(tmp_path, num_rounds=3, final_rate=0.7, target_epsilon=3.0)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert rounds[-1]["test_accuracy"] > 0.5  # chance is 0.1
    eps = [r["epsilon_max"] for r in rounds]
    assert eps[0] < eps[1] < eps[2] <= 3.0 + 1e-6 and eps[2] > 2.5
    for r in rounds:
        assert r["rejected"] == [] and r["num_replies"] == 4
        keep = keep_count(D_DIGITS, rate=r["rate"])
        assert r["keep"] == keep
        encoding = "dense" if keep == D_DIGITS else "seeded"
        one = payload_size(
            keep=keep,
            dense_size=D_DIGITS,
            round=r["round"],
            encoding=encoding,
            value_dtype="fp32",
            mask_seed=0 if encoding == "dense" else round_seed(0, r["round"]),
        )
        assert r["uplink_payload_bytes"] == 4 * one
        assert one - keep * 4 <= 64  # values only: no index bytes
        assert r["dense_uplink_bytes"] == 4 * D_DIGITS * 4
        # Flower's message objects add a small, fixed framing on top of the payload.
        assert (
            r["uplink_payload_bytes"] < r["uplink_message_bytes"] < 1.02 * r["uplink_payload_bytes"]
        )
    # Round 3 downlink: clients hold version 1 and miss only round 2's masked coordinates,
    # sent as values on round 2's seeded mask.
    keep2 = keep_count(D_DIGITS, rate=rounds[1]["rate"])
    assert rounds[2]["downlink_payload_bytes"] == 4 * payload_size(
        keep=keep2,
        dense_size=D_DIGITS,
        round=3,
        encoding="seeded",
        value_dtype="fp32",
        mask_seed=round_seed(0, 2),
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["uplink_savings"] == pytest.approx(
        sum(r["dense_uplink_bytes"] for r in rounds)
        / sum(r["uplink_payload_bytes"] for r in rounds)
    )
    checkpoint = torch.load(tmp_path / "checkpoint.pt")
    assert checkpoint["round"] == 3 and torch.isfinite(checkpoint["weights"]).all()


def test_dense_noise_free_round_equals_fedavg_of_local_updates(tmp_path: Path) -> None:
    """final-rate=0, sigma=0, full participation: the new model is dense FedAvg.

    Weighted by the claimed example counts (``weighting="examples"``) and without the relative
    norm bound (noise-free updates of unequal partitions differ in norm by more than 3x).
    """
    seen: list[tuple[torch.Tensor, int]] = []

    def recording(msg: Message, ctx: Context) -> Message:
        reply = client_app(msg, ctx)
        conf = reply.content.config_records[CONFIG_RECORD]
        update = decode_update(bytes(conf["update"]))
        seen.append(
            (update.to_dense(), int(reply.content.metric_records[METRICS_RECORD]["num-examples"]))
        )
        return reply

    cfg_kwargs = dict(
        num_rounds=1,
        final_rate=0.0,
        target_epsilon=0.0,
        noise_multiplier=0.0,
        partitioner="dirichlet",
        dirichlet_alpha=1.0,
        weighting="examples",
        max_norm_ratio=0.0,
    )
    nodes = {1001 + i: recording for i in range(3)}
    run(tmp_path, nodes=3, overrides=nodes, **cfg_kwargs)
    from fedsparse.common.layout import ParamLayout
    from fedsparse.common.models.classifiers import build_model

    cfg = FederatedConfig(**cfg_kwargs)
    model = build_model(cfg.model_name, seed=0)
    w0 = ParamLayout.from_module(model).flatten_module(model)
    total = sum(n for _, n in seen)
    assert len({n for _, n in seen}) > 1  # unequal weights make the check meaningful
    expected = w0 + sum(delta * (n / total) for delta, n in seen)
    got = torch.load(tmp_path / "checkpoint.pt")["weights"]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def corrupt(kind: str):
    def handler(msg: Message, ctx: Context) -> Message:
        if kind == "raise":
            raise RuntimeError("disk on fire")
        reply = client_app(msg, ctx)
        conf = reply.content.config_records[CONFIG_RECORD]
        payload = bytes(conf["update"])
        if kind == "truncate":
            payload = payload[: len(payload) // 2]
        elif kind == "nan":
            payload = payload[:-4] + bytes.fromhex("0000c07f")  # a float32 NaN as the last value
        reply.content.config_records[CONFIG_RECORD] = ConfigRecord({"update": payload})
        return reply

    return handler


def test_bad_clients_are_dropped_and_honest_ones_aggregate(tmp_path: Path) -> None:
    bad = {1001: corrupt("truncate"), 1002: corrupt("nan"), 1003: corrupt("raise")}
    rounds = run(tmp_path, nodes=5, overrides=bad, num_rounds=2, final_rate=0.5)
    for r in rounds:
        assert r["num_replies"] == 5 and r["num_rejected"] == 3
        reasons = " | ".join(r["rejected"])
        assert "node 1001: payload: not a fedsparse.v1.SparseUpdate" in reasons
        assert "node 1002: values: 1 non-finite" in reasons
        assert "node 1003: client error: RuntimeError: disk on fire" in reasons
        keep = r["keep"]
        encoding = "dense" if keep == D_DIGITS else "seeded"
        one = payload_size(
            keep=keep,
            dense_size=D_DIGITS,
            round=r["round"],
            encoding=encoding,
            value_dtype="fp32",
            mask_seed=0 if encoding == "dense" else round_seed(0, r["round"]),
        )
        assert r["uplink_payload_bytes"] == 2 * one  # only the two honest clients count
    assert rounds[-1]["test_accuracy"] > 0.2
    assert torch.isfinite(torch.load(tmp_path / "checkpoint.pt")["weights"]).all()


def test_per_client_masks_touch_the_union(tmp_path: Path) -> None:
    rounds = run(
        tmp_path, nodes=3, num_rounds=2, final_rate=0.9, mask_scope="client", schedule="constant"
    )
    assert all(r["rejected"] == [] for r in rounds)
    # The server sends the missing values with an explicit support (union of 3 client masks,
    # 27% of d): "auto" picks the bitmap (d/8 bytes) over delta varints (~1 B per index here)
    # and COO (4 B per index), so each download is ~ 4 B per union value + d/8.
    keep = keep_count(D_DIGITS, rate=0.9)
    union = D_DIGITS * (1 - 0.9**3)
    per_client = rounds[1]["downlink_payload_bytes"] / 3
    assert abs((per_client - math.ceil(D_DIGITS / 8)) / 4 - union) < 5 * math.sqrt(union)
    assert rounds[0]["uplink_payload_bytes"] < 3 * (keep * 4 + 64)


def test_fp16_uplink_halves_payload(tmp_path: Path) -> None:
    r32 = run(tmp_path / "a", nodes=2, num_rounds=1, final_rate=0.5, schedule="constant")
    r16 = run(
        tmp_path / "b",
        nodes=2,
        num_rounds=1,
        final_rate=0.5,
        schedule="constant",
        value_dtype="fp16",
    )
    keep = keep_count(D_DIGITS, rate=0.5)
    assert r32[0]["uplink_payload_bytes"] - r16[0]["uplink_payload_bytes"] == 2 * keep * 2


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("final-rate", 1.2, "final-rate=1.2"),
        ("mask-scope", "global", "mask-scope='global'"),
        ("lr", "fast", "lr='fast'"),
        ("num-round", 3, "'num-round' is unknown"),
    ],
)
def test_run_config_errors_name_key_and_value(key: str, value, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FederatedConfig.from_run_config({key: value})


def test_sparse_aggregator_weighted_per_coordinate_mean() -> None:
    agg = SparseAggregator(5)
    agg.add(torch.tensor([1.0, 2.0]), support=torch.tensor([0, 2]), weight=1.0)
    agg.add(torch.tensor([3.0, 4.0]), support=torch.tensor([2, 3]), weight=3.0)
    w = torch.zeros(5)
    touched = agg.apply_(w)
    assert touched.tolist() == [True, False, True, True, False]
    torch.testing.assert_close(w, torch.tensor([1.0, 0.0, (2 + 9) / 4, 4.0, 0.0]))
    with pytest.raises(ValueError, match="weight=0"):
        agg.add(torch.tensor([1.0]), support=torch.tensor([1]), weight=0)


@pytest.fixture(scope="module")
def values_codec_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], torch.Tensor]:
    out = tmp_path_factory.mktemp("values")
    rounds = run(out, nodes=2, num_rounds=2, final_rate=0.7, schedule="constant")
    return rounds, torch.load(out / "checkpoint.pt")["weights"]


@pytest.mark.parametrize("codec", ["coo", "delta", "bitmap", "auto"])
def test_explicit_codecs_train_the_same_model_and_cost_their_index_bytes(
    tmp_path: Path, codec: str, values_codec_run: tuple[list[dict], torch.Tensor]
) -> None:
    """Only the support's encoding changes: the aggregated model is bit-identical."""
    base, weights = values_codec_run
    rounds = run(tmp_path, nodes=2, num_rounds=2, final_rate=0.7, schedule="constant", codec=codec)
    assert torch.equal(torch.load(tmp_path / "checkpoint.pt")["weights"], weights)
    keep = keep_count(D_DIGITS, rate=0.7)
    index_bytes = {
        "coo": 4 * keep,
        "bitmap": math.ceil(D_DIGITS / 8),
        # mean gap 3.3: one varint byte per index, two for the rare gaps >= 128
        "delta": keep,
        "auto": 0,  # the seed is known: values only
    }[codec]
    for r, b in zip(rounds, base, strict=True):
        assert r["test_accuracy"] == b["test_accuracy"] and r["rejected"] == []
        extra = (r["uplink_payload_bytes"] - b["uplink_payload_bytes"]) / 2  # per client
        # + the indices field's tag and length, - the mask seed varint (10 bytes for 63 bits)
        assert abs(extra - index_bytes) <= 16 if codec != "auto" else extra == 0


def test_int8_zstd_uplink_is_a_quarter_and_still_learns(
    tmp_path: Path, values_codec_run: tuple[list[dict], torch.Tensor]
) -> None:
    base, _ = values_codec_run
    rounds = run(
        tmp_path,
        nodes=2,
        num_rounds=2,
        final_rate=0.7,
        schedule="constant",
        value_dtype="int8",
        compression="zstd",
    )
    for r, b in zip(rounds, base, strict=True):
        assert r["rejected"] == []
        assert r["uplink_payload_bytes"] < 0.27 * b["uplink_payload_bytes"]
        # Quantization error (<= max|v|/254 per value) barely moves the model.
        assert abs(r["test_accuracy"] - b["test_accuracy"]) < 0.05


def test_a_support_other_than_the_round_mask_is_rejected(tmp_path: Path) -> None:
    def shifted(msg: Message, ctx: Context) -> Message:
        reply = client_app(msg, ctx)
        update = decode_update(bytes(reply.content.config_records[CONFIG_RECORD]["update"]))
        assert update.indices is not None
        moved = torch.clamp(update.indices + 1, max=D_DIGITS - 1).unique()
        payload = encode_update(
            update.values[: len(moved)],
            dense_size=D_DIGITS,
            round=update.round,
            indices=moved,
            encoding="coo",
        )
        reply.content.config_records[CONFIG_RECORD] = ConfigRecord({"update": payload})
        return reply

    rounds = run(
        tmp_path,
        nodes=3,
        overrides={1001: shifted},
        num_rounds=1,
        final_rate=0.7,
        schedule="constant",
        codec="coo",
    )
    assert rounds[0]["num_rejected"] == 1
    reason = rounds[0]["rejected"][0]
    assert reason.startswith("node 1001: ") and (
        "not the round's mask" in reason or "keep" in reason
    )
