"""Atomic replacement (``fedsparse.common.atomic``) and the files that use it."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from fedsparse.common import atomic
from fedsparse.common.atomic import PRIVATE, SHARED, open_atomic, write_atomically

ROOT = Path(__file__).resolve().parents[2]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022() -> object:
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_writes_the_content(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    write_atomically(path, '{"é": 1}')  # str: UTF-8
    assert path.read_bytes() == '{"é": 1}'.encode()
    write_atomically(path, b"\x00\xff")
    assert path.read_bytes() == b"\x00\xff"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]  # no temporary file left


def test_replaces_the_file_not_its_content(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("old, and longer than the new")
    reader = path.open()  # a reader that opened the old file keeps reading the old file
    inode = path.stat().st_ino
    write_atomically(path, "new")
    assert path.read_text() == "new"
    assert path.stat().st_ino != inode
    assert reader.read() == "old, and longer than the new"
    reader.close()


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"round 3")
    with pytest.raises(RuntimeError, match="killed mid-write"), open_atomic(path) as fh:
        fh.write(b"round 4, half of it")
        raise RuntimeError("killed mid-write")
    assert path.read_bytes() == b"round 3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_a_failed_rename_leaves_no_temporary(tmp_path: Path) -> None:
    folder = tmp_path / "taken"
    folder.mkdir()
    (folder / "x").write_text("a folder cannot be replaced by a file")
    with pytest.raises(OSError):
        write_atomically(folder, "data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_a_missing_folder_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_atomically(tmp_path / "no-such-folder" / "a.json", "{}")


@pytest.mark.usefixtures("umask_022")
def test_mode_private_by_default_and_shared_less_the_umask(tmp_path: Path) -> None:
    private, shared = tmp_path / "ledger.json", tmp_path / "rounds.jsonl"
    write_atomically(private, "{}")
    write_atomically(shared, "{}", mode=SHARED)
    assert _mode(private) == PRIVATE == 0o600
    assert _mode(shared) == 0o644  # what open(path, "w") gives under umask 022
    shared.chmod(0o666)
    write_atomically(shared, "{}", mode=PRIVATE)  # the new file's mode, not the old one's
    assert _mode(shared) == 0o600


def test_the_file_and_its_folder_are_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    write_atomically(tmp_path / "a", "x")
    assert synced == ["file", "folder"]  # the bytes, then the rename


def test_concurrent_writers_use_their_own_temporaries(tmp_path: Path) -> None:
    path = tmp_path / "a"
    with open_atomic(path) as first, open_atomic(path) as second:
        first.write(b"first")
        second.write(b"second")
        assert len(list(tmp_path.iterdir())) == 2
    assert path.read_bytes() == b"first"  # the outer block ends last: its file wins


# ---------------------------------------------------------------------------------------------
# The files the project rewrites go through it, with the permissions each needs.


def test_ledger_state_checkpoint_and_run_log_use_the_helper(
    tmp_path: Path, umask_022: object
) -> None:
    import torch

    from fedsparse.client.ledger import PrivacyLedger
    from fedsparse.client.node_policy import TrainingRequest
    from fedsparse.client.state import NodeState, StateFiles
    from fedsparse.server.checkpoint import Checkpoint
    from fedsparse.server.run_records import _replace_text

    ledger = PrivacyLedger(tmp_path / "ledger" / "digits.json")
    request = TrainingRequest(
        run_id=1,
        server_round=1,
        noise_multiplier=1.0,
        mechanism="dpsgd",
        sample_rate=0.01,
        steps=100,
        local_epochs=1,
    )
    ledger.charge(request, budget=10.0, delta=1e-5)
    files = StateFiles(root=tmp_path / "state", partition_id=0)
    files.save(NodeState(last_round=2))
    ck = tmp_path / "checkpoint.pt"
    Checkpoint(round=1, weights=torch.zeros(3), names=["w"], shapes=[(3,)], config={}).save(ck)
    log = tmp_path / "rounds.jsonl"
    _replace_text(log, '{"round": 1}\n')

    assert [e.server_round for e in PrivacyLedger(ledger.path).entries()] == [1]
    assert json.loads((files.folder / "round-2.json").read_text())["last-round"] == 2
    assert torch.load(ck, weights_only=True)["round"] == 1
    assert log.read_text() == '{"round": 1}\n'
    assert _mode(ledger.path) == _mode(files.folder / "round-2.json") == 0o600  # the node's
    assert _mode(ck) == _mode(log) == 0o644  # the operator's outputs, as before
    leftovers = [p.name for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []


def test_no_other_module_writes_a_temporary_and_renames_it() -> None:
    found = []
    for package in ("common", "client", "server", "lab"):
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            if path.name != "atomic.py" and (".tmp" in text or "os.replace(" in text):
                found.append(str(path.relative_to(ROOT)))
    assert found == []
