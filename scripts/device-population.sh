#!/usr/bin/env bash
# The population engine on a GPU (issue 41): its CUDA equivalence tests and the benchmark of
# K clients batched on one GPU against Opacus's per-client loop (benchmarks/population_gpu.py).
#
# Run on a machine with a GPU and torch (its system Python), fedsparse's other dependencies
# installed or given as wheels in .whl/ (opacus, zstandard, dill, protobuf: docs/gpu/README.md):
#
#     scripts/device-population.sh [OUT_DIR]
#
# As scripts/device-check.sh, a folder of links maps `fedsparse.*` onto the checkout. Flower is
# not needed: the client round and the population runner import none of it.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-runs/device-population}}
mkdir -p "$out"
py=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/fedsparse-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/fedsparse-site${PYTHONPATH:+:$PYTHONPATH}
fi
pkg=$(mktemp -d)
mkdir -p "$pkg/fedsparse"
for part in common client server lab; do ln -s "$PWD/$part" "$pkg/fedsparse/$part"; done
ln -s "$PWD/protos/fedsparse/v1" "$pkg/fedsparse/v1"
export PYTHONPATH=$pkg:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
{
    nvidia-smi -L
    "$py" -c 'import sys, torch, opacus; print(sys.version.split()[0], "torch", torch.__version__,
"opacus", opacus.__version__, torch.cuda.get_device_name(0))'
} 2>&1 | tee "$out/env.txt"
# 1. population_round on CUDA equals client_round on CUDA (both engines, three settings).
timeout "${TEST_TIMEOUT:-240}" "$py" -m pytest -q -p no:cacheprovider -rfE --tb=short \
    tests/client/test_population.py -k cuda 2>&1 | tee "$out/tests-population-cuda.log"
status=${PIPESTATUS[0]}
# 2. K clients batched on the GPU against Opacus's per-client loop on it.
timeout "${BENCH_TIMEOUT:-300}" "$py" benchmarks/population_gpu.py --device cuda \
    --models "${MODELS:-digits-cnn,dpcnn}" --clients "${CLIENTS:-100,1000}" --loop-clients 32 \
    --reps 3 2>&1 | tee "$out/population-gpu.txt"
# 3. The same on the machine's CPU cores (digits only), for the GPU's ratio to them.
[ -n "${SKIP_CPU:-}" ] ||
    timeout "${CPU_TIMEOUT:-150}" "$py" benchmarks/population_gpu.py --device cpu \
        --models digits-cnn --clients 100,1000 --loop-clients 32 --reps 3 2>&1 |
    tee "$out/population-cpu.txt"
exit "$status"
