"""``fedsparse.lab.launch.compose``: the checked-in compose files are its output; N nodes;
comparison."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from fedsparse.common.wire.run_log import RoundLog
from fedsparse.lab.launch.compose import (
    DEFAULT_NODES,
    compose_document,
    insecure_overlay,
    load_compose,
    main,
    write_compose,
)
from fedsparse.lab.launch.compose_check import compare_rounds

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("checked_in", "overlay"),
    [("docker-compose.yml", None), ("deploy/insecure.yml", "insecure"), ("deploy/gpu.yml", "gpu")],
)
def test_checked_in_files_are_the_generators_output(
    tmp_path: Path, checked_in: str, overlay: Any
) -> None:
    written = write_compose(tmp_path / "out.yml", DEFAULT_NODES, overlay=overlay)
    assert (ROOT / checked_in).read_text() == written.read_text(), (
        f"{checked_in} drifted from lab/launch/compose.py: regenerate it with "
        f"`python -m fedsparse.lab.launch.compose{' --overlay ' + overlay if overlay else ''} "
        f"--out {checked_in}`"
    )


def test_main_writes_what_write_compose_writes(tmp_path: Path) -> None:
    assert main(["--nodes", "4", "--out", str(tmp_path / "a.yml")]) == 0
    write_compose(tmp_path / "b.yml", 4)
    assert (tmp_path / "a.yml").read_text() == (tmp_path / "b.yml").read_text()


@pytest.mark.parametrize("nodes", [1, 5])
def test_n_nodes_each_with_its_partition_ledger_and_key(nodes: int) -> None:
    document = compose_document(nodes)
    services = document["services"]
    assert list(services) == ["superlink", *(f"supernode-{i}" for i in range(nodes))]
    assert list(document["volumes"]) == ["runs", *(f"ledger-{i}" for i in range(nodes))]
    for i in range(nodes):
        node = services[f"supernode-{i}"]
        command = node["command"]
        assert command[-1].startswith(f"partition-id={i} num-partitions={nodes} ")
        key = command[command.index("--auth-supernode-private-key") + 1]
        assert key == f"/app/keys/node-{i}"
        assert f"./deploy/certs/nodes/node-{i}:{key}:ro" in node["volumes"]
        assert f"ledger-{i}:/var/lib/fedsparse/ledger" in node["volumes"]
    assert "--enable-supernode-auth" in services["superlink"]["command"]


def test_insecure_mounts_nothing_and_says_so() -> None:
    services = compose_document(2, insecure=True)["services"]
    for service in services.values():
        assert "--insecure" in service["command"]
        assert not {"--enable-supernode-auth", "--auth-supernode-private-key"} & set(
            service["command"]
        )
        assert all(not volume.startswith("./") for volume in service["volumes"])


def test_host_folders_for_runs_and_certificates(tmp_path: Path) -> None:
    document = compose_document(
        2, certs=f"{tmp_path}/certs/", runs=str(tmp_path / "runs"), build_context="/src"
    )
    link = document["services"]["superlink"]
    assert f"{tmp_path}/runs:/runs" in link["volumes"]
    assert f"{tmp_path}/certs/server.key:/app/certificates/server.key:ro" in link["volumes"]
    assert "runs" not in document["volumes"]  # a bind mount, not a named volume
    assert link["build"]["context"] == "/src"


def test_overlay_volumes_replace_the_base_files(tmp_path: Path) -> None:
    path = write_compose(tmp_path / "insecure.yml", 2, overlay="insecure")
    assert "    volumes: !override\n" in path.read_text()
    parsed = load_compose(path)
    assert parsed["services"] == insecure_overlay(2)["services"]


def test_no_nodes_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nodes=0"):
        compose_document(0)
    with pytest.raises(SystemExit):
        main(["--nodes", "0", "--out", str(tmp_path / "x.yml")])


def _round(number: int, **changes: Any) -> RoundLog:
    values: dict[str, Any] = {
        "round": number,
        "num_clients": 3,
        "num_replies": 3,
        "num_rejected": 0,
        "rate": 0.0,
        "keep": 38282,
        "keep_fraction": 1.0,
        "test_accuracy": 0.5,
        "test_loss": 1.0,
        "epsilon_max": 2.0,
        "epsilon_median": 2.0,
        "train_loss": 1.0,
        "uplink_payload_bytes": 459444,
        "uplink_message_bytes": 462000,
        "downlink_payload_bytes": 459384,
        "downlink_message_bytes": 461000,
        "dense_uplink_bytes": 459384,
        "dense_downlink_bytes": 459384,
        "wall_seconds": 1.0,
        "started_at": 0.0,
        "ended_at": 1.0,
        "rejected": [],
    }
    return RoundLog(**{**values, **changes})


def test_identical_runs_agree() -> None:
    runs = [_round(1), _round(2, keep=20000, uplink_payload_bytes=240000)]
    result = compare_rounds(runs, list(runs))
    assert result.agree and result.identical
    assert len(result.table) == 2 and "uplink_payload 459444/459444" in result.table[0]


def test_message_bytes_may_differ_by_a_few_bytes_per_message() -> None:
    sim = [_round(1)]
    dep = [_round(1, uplink_message_bytes=462000 + 3 * 27, downlink_message_bytes=461000 - 3)]
    result = compare_rounds(dep, sim)
    assert result.agree and not result.identical
    assert any("+81 B" in line for line in result.differences)
    far = compare_rounds([_round(1, uplink_message_bytes=462000 + 301)], sim)
    assert not far.agree and "beyond 100 B x 3 messages" in far.problems[0]


def test_payload_bytes_and_round_counts_must_match() -> None:
    sim = [_round(1), _round(2)]
    assert not compare_rounds([_round(1, uplink_payload_bytes=459445), _round(2)], sim).agree
    short = compare_rounds(sim[:1], sim)
    assert short.problems == ["rounds: 1 deployed, 2 simulated"]


def test_compare_command_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, rounds in {
        "sim": [_round(1)],
        "same": [_round(1)],
        "other": [_round(1, downlink_payload_bytes=1)],
    }.items():
        (tmp_path / name).mkdir()
        lines = [json.dumps(dataclasses.asdict(r)) for r in rounds]
        (tmp_path / name / "rounds.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["--compare", str(tmp_path / "same"), str(tmp_path / "sim")]) == 0
    assert "identical" in capsys.readouterr().out
    assert main(["--compare", str(tmp_path / "other"), str(tmp_path / "sim")]) == 1
    assert "downlink_payload_bytes 1 deployed" in capsys.readouterr().err
