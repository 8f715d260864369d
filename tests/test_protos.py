"""The committed protobuf modules are exactly what scripts/gen_protos.sh generates."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import google.protobuf
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "protos" / "fedsparse" / "v1"
GENERATED = ("payload_pb2.py", "payload_pb2.pyi")


def _protoc_version() -> str:
    out = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def test_generated_protos_are_up_to_date(tmp_path: Path) -> None:
    # Run the real script on a copy of protos/ holding only the .proto sources, so a script
    # that stops writing (or writes elsewhere) fails too.
    shutil.copytree(ROOT / "protos", tmp_path / "protos", ignore=shutil.ignore_patterns("*_pb2*"))
    (tmp_path / "scripts").mkdir()
    shutil.copy2(ROOT / "scripts" / "gen_protos.sh", tmp_path / "scripts" / "gen_protos.sh")
    run = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "gen_protos.sh")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, f"scripts/gen_protos.sh failed:\n{run.stdout}{run.stderr}"
    out_dir = tmp_path / "protos" / "fedsparse" / "v1"
    sources = sorted(p.stem for p in PROTO_DIR.glob("*.proto"))
    assert sources == ["payload"], f"new .proto files {sources}: add them to gen_protos.sh"
    stale = [
        name
        for name in GENERATED
        if not (PROTO_DIR / name).exists()
        or (PROTO_DIR / name).read_bytes() != (out_dir / name).read_bytes()
    ]
    assert not stale, (
        f"{', '.join(stale)} differ from what {_protoc_version()} generates from "
        "protos/fedsparse/v1/payload.proto: run scripts/gen_protos.sh and commit the result"
    )


def test_generated_module_imports_and_pins_the_schema() -> None:
    # The gencode embeds a runtime check: it imports only under a runtime of the same major
    # version and at least its own version.
    header = (PROTO_DIR / "payload_pb2.py").read_text().splitlines()
    line = next(x for x in header if x.startswith("# Protobuf Python Version: "))
    gencode = tuple(int(x) for x in line.rsplit(" ", 1)[1].split("."))
    runtime = tuple(int(x) for x in google.protobuf.__version__.split(".")[:3])
    assert gencode[0] == runtime[0] and gencode <= runtime, (gencode, runtime)

    from fedsparse.v1 import payload_pb2

    assert payload_pb2.SparseUpdate.DESCRIPTOR.full_name == "fedsparse.v1.SparseUpdate"
    fields = {f.name: f.number for f in payload_pb2.SparseUpdate.DESCRIPTOR.fields}
    assert fields == {
        "format_version": 1,
        "dense_size": 2,
        "round": 3,
        "index_encoding": 4,
        "mask_seed": 5,
        "keep": 6,
        "value_dtype": 8,
        "indices": 10,
        "values": 11,
        "value_scale": 12,
        "compression": 13,
        "value_block": 14,
        "value_scales": 15,
    }
    proto = descriptor_pb2.DescriptorProto()
    payload_pb2.SparseUpdate.DESCRIPTOR.CopyToProto(proto)
    assert list(proto.reserved_range) == []  # 14 and 15 were reserved for the blocked codecs
    assert payload_pb2.SparseUpdate.DESCRIPTOR.fields_by_name["value_scale"].has_presence
    assert dict(payload_pb2.ValueDtype.items()) == {
        "VALUE_DTYPE_UNSPECIFIED": 0,
        "VALUE_DTYPE_FP32": 1,
        "VALUE_DTYPE_FP16": 2,
        "VALUE_DTYPE_BF16": 3,
        "VALUE_DTYPE_INT8": 4,
        "VALUE_DTYPE_INT4": 5,
        "VALUE_DTYPE_INT2": 6,
        "VALUE_DTYPE_INT1": 7,
    }
    assert dict(payload_pb2.IndexEncoding.items()) == {
        "INDEX_ENCODING_UNSPECIFIED": 0,
        "INDEX_ENCODING_SEEDED_MASK": 1,
        "INDEX_ENCODING_DENSE": 2,
        "INDEX_ENCODING_COO_INT32": 3,
        "INDEX_ENCODING_DELTA_VARINT": 4,
        "INDEX_ENCODING_BITMAP": 5,
    }
    assert dict(payload_pb2.Compression.items()) == {
        "COMPRESSION_NONE": 0,
        "COMPRESSION_ZSTD": 1,
    }
