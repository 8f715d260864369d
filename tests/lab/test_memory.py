"""``retain_freed_memory``: a training step's large buffers stop being faulted in again."""

import platform
import subprocess
import sys

import pytest

GLIBC = platform.libc_ver()[0] == "glibc"

# A training step's shape of memory: large buffers (32, 16 and 16 MiB, at and above glibc's
# default mmap threshold) allocated and freed every step; prints the page faults per step
# after a warm-up.
STEPS = """
import resource, sys, torch
if sys.argv[1] == "retain":
    from fedsparse.lab.simulation.memory import retain_freed_memory
    assert retain_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():
    a = torch.empty(8 << 20).fill_(1.0)
    b = torch.empty(4 << 20).fill_(2.0)
    c = a[: 4 << 20] + b
    del a, b, c
for _ in range(5):
    step()
before = faults()
for _ in range(20):
    step()
print((faults() - before) / 20)
"""


def _faults_per_step(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip())


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_retained_memory_is_not_faulted_in_again() -> None:
    default, retained = _faults_per_step("default"), _faults_per_step("retain")
    # 64 MiB of buffers a step is 16,384 pages: glibc's defaults return and fault most of them.
    assert default > 4_000
    assert retained < default / 10


def test_it_reports_whether_glibc_took_the_settings() -> None:
    # Run in a child: the settings are process-wide and must not leak into the test run.
    code = (
        "from fedsparse.lab.simulation.memory import retain_freed_memory\n"
        "print(retain_freed_memory())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(GLIBC)
