#!/usr/bin/env bash
# `make test-containers`: the compose deployment, for real, against a simulation.
#
# With podman (root) and podman-compose, on a machine without Docker Hub:
#   1. setup    podman, runc, debootstrap (apt) and podman-compose==1.6.0 (build/compose-venv)
#               if missing; /etc/containers/containers.conf with runc and lower rlimits
#   2. base     localhost/debian-bookworm:min from debootstrap (only if absent)
#   3. image    fedsparse:0.1.0 from deploy/docker/fedsparse/Dockerfile on that base, pip
#               configured like this machine's pip (its pip.conf, wheel dirs, CA bundle)
#   4. certs    deploy/certs/generate.sh: CA, server certificate, N SuperNode key pairs,
#               into a temporary directory (never the repository)
#   5. up       `python -m fedsparse.lab.launch.compose --nodes N` (TLS + SuperNode auth), up -d
#   6. register `flwr supernode register` for each public key; wait until all are online
#   6b. isolate from a SuperNode container: the Fleet API is reachable, the Control API
#               (which starts runs, i.e. ships code) and the SuperLink's key are not
#   7. run      `flwr run <app bundle> containers --stream`, rounds.jsonl in a bind-mounted
#               /runs
#   8. simulate the same run config, `fedsparse simulate --clients N`
#   9. compare  rounds and per-round bytes (`python -m fedsparse.lab.launch.compose --compare`)
# Containers, networks and volumes are removed however it ends (`podman-compose down -v`).
#
# Environment: NODES (3), ROUNDS (3), KEEP_WORK=1 keeps the temporary directory,
# REBUILD=1 rebuilds the image without the layer cache, STOP_AFTER=<phase> stops after that phase (e.g. image),
# BASE_IMAGE (localhost/debian-bookworm:min), IMAGE.
# Exit status: 0 passed; 77 the machine cannot run containers (not root, or podman, runc,
# debootstrap or podman-compose could not be installed: `.ci/run` reports it as skipped);
# anything else failed.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
VENV=${VENV:-.venv}
[[ $VENV == /* ]] || VENV="$ROOT/$VENV"
PY="$VENV/bin/python"
NODES=${NODES:-3}
ROUNDS=${ROUNDS:-3}
BASE_IMAGE=${BASE_IMAGE:-localhost/debian-bookworm:min}
IMAGE=${IMAGE:-localhost/fedsparse:0.1.0}
COMPOSE_VENV="$ROOT/build/compose-venv"
PODMAN_COMPOSE="$COMPOSE_VENV/bin/podman-compose"
PROJECT=fedsparse-test
# The same run config for both runs (`fedsparse simulate --set` syntax); out-dir is per run.
RUN_CONFIG=("num-rounds=$ROUNDS" "min-clients=$NODES" "clients-per-round=0" "dataset=digits"
  "final-rate=0.5" "seed=0")

T0=$(date +%s)
PHASE_START=$T0
TIMINGS=()
phase() { # phase NAME: closes the running phase (its time) and announces the next
  local now
  now=$(date +%s)
  if [[ -n ${PHASE:-} ]]; then TIMINGS+=("$(printf '%-9s %4d s' "$PHASE" $((now - PHASE_START)))"); fi
  if [[ -n ${STOP_AFTER:-} && ${PHASE:-} == "$STOP_AFTER" && $1 != done ]]; then
    PHASE=""
    exit 0
  fi
  PHASE=$1
  PHASE_START=$now
  [[ $1 == done ]] || echo "== $1"
}

WORK=$(mktemp -d /tmp/fedsparse-containers.XXXXXX)
COMPOSE_FILE="$WORK/compose.yml"
UP=0
cleanup() {
  local status=$?
  if ((UP)); then
    echo "== teardown"
    if ((status != 0)); then
      "$PODMAN_COMPOSE" -p "$PROJECT" -f "$COMPOSE_FILE" logs --tail 30 2>&1 | tail -120 || true
    fi
    "$PODMAN_COMPOSE" -p "$PROJECT" -f "$COMPOSE_FILE" down -v -t 5 >"$WORK/down.log" 2>&1 ||
      cat "$WORK/down.log"
  fi
  if [[ ${KEEP_WORK:-0} == 1 ]]; then echo "kept $WORK"; else rm -rf "$WORK"; fi
  phase done
  printf '  %s\n' "${TIMINGS[@]}"
  echo "total $(($(date +%s) - T0)) s: $([[ $status == 0 ]] && echo PASSED || echo "FAILED ($status)")"
}
trap cleanup EXIT

# --- 1. setup ---------------------------------------------------------------------------
phase setup
if [[ $(id -u) != 0 ]]; then
  echo "needs root: rootful podman, apt-get, /etc/containers/containers.conf" >&2
  exit 77
fi
missing=()
for tool in podman runc debootstrap ssh-keygen openssl; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if ((${#missing[@]})); then
  packages=("${missing[@]/ssh-keygen/openssh-client}")
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${packages[@]}"; } ||
    { echo "cannot install ${packages[*]}: no containers on this machine" >&2; exit 77; }
fi
if [[ ! -x $PODMAN_COMPOSE ]]; then
  { python3 -m venv "$COMPOSE_VENV" && "$COMPOSE_VENV/bin/pip" install -q "podman-compose==1.6.0"; } ||
    { echo "cannot install podman-compose: no containers on this machine" >&2; exit 77; }
fi
podman info >"$WORK/podman-info.log" 2>&1 ||
  { tail -5 "$WORK/podman-info.log"; echo "podman does not work here" >&2; exit 77; }
# This sandbox's kernel: crun fails on cgroups v1 hybrid mode and podman's default rlimits are
# refused. Written once; an existing containers.conf without them is left alone and a private
# copy with them is used instead (CONTAINERS_CONF).
CONF=/etc/containers/containers.conf
SETTINGS='[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]

[engine]
runtime = "runc"'
if [[ ! -e $CONF ]]; then
  mkdir -p "$(dirname "$CONF")"
  printf '# Written by fedsparse scripts/test-containers.sh\n%s\n' "$SETTINGS" >"$CONF"
elif ! grep -q '^runtime *= *"runc"' "$CONF" || ! grep -q '^default_ulimits' "$CONF"; then
  echo "$CONF lacks runc/ulimits settings: using a private copy for this run"
  printf '%s\n' "$SETTINGS" >"$WORK/containers.conf"
  export CONTAINERS_CONF="$WORK/containers.conf"
fi

# --- 2. base image ----------------------------------------------------------------------
phase base
if [[ $BASE_IMAGE == localhost/debian-bookworm:min ]] && ! podman image exists "$BASE_IMAGE"; then
  # The Debian mirror apt uses here (deb822 or one-line sources).
  MIRROR=$(grep -hoE '(URIs:|^deb) +https?://[^ ]+/debian/?( |$)' \
    /etc/apt/sources.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
    grep -oE 'https?://[^ ]+' | head -1 || true)
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
  ROOTFS=$(mktemp -d /var/tmp/fedsparse-rootfs.XXXXXX)
  debootstrap --variant=minbase bookworm "$ROOTFS" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 ||
    { tail -20 "$WORK/debootstrap.log"; echo "debootstrap failed: no base image" >&2; exit 77; }
  tar -C "$ROOTFS" -c . | podman import - "$BASE_IMAGE" >"$WORK/import.log" 2>&1 ||
    { cat "$WORK/import.log"; exit 1; }
  rm -rf "$ROOTFS"
fi

# --- 3. image ---------------------------------------------------------------------------
phase image
# Built every time: podman's layer cache keeps an unchanged tree fast, and a changed one (code,
# pyproject.toml) must never be tested with an image left by an earlier run. REBUILD=1: no cache.
  # pip inside the build is configured like this machine's: its index/find-links settings
  # (directories mounted read-only at the same paths) and its CA bundle. Users building
  # elsewhere pass nothing of this and get the Dockerfile's defaults.
  BUILD_MOUNTS=()
  "$PY" - "$WORK/pip.conf" >"$WORK/pip-mounts" <<'EOF'
import subprocess, sys
values = {}
for line in subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                           text=True, check=True).stdout.splitlines():
    key, _, value = line.partition("=")
    values[key.split(".", 1)[1]] = value.strip("'\"")  # later scopes (env) win
lines, mounts = ["[global]"], set()
for key in ("index-url", "extra-index-url", "find-links"):
    if key in values:
        lines.append(f"{key} = {values[key]}")
        for item in values[key].split():
            path = item.removeprefix("file://")
            if path.startswith("/"):
                mounts.add(path.rstrip("/").rsplit("/simple", 1)[0] or path)
if "cert" in values:
    lines.append("cert = /etc/pip-ca.crt")
    print(f"{values['cert']}:/etc/pip-ca.crt:ro")
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
for path in sorted(mounts):
    print(f"{path}:{path}:ro")
EOF
  while read -r mount; do BUILD_MOUNTS+=(-v "$mount"); done <"$WORK/pip-mounts"
  FLWR_VERSION=$("$PY" -c 'import importlib.metadata as m; print(m.version("flwr"))')
  podman build --network=host \
    -f deploy/docker/fedsparse/Dockerfile \
    --ignorefile deploy/docker/fedsparse/Dockerfile.dockerignore \
    --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg TORCH_INDEX_URL= \
    --build-arg FLWR_VERSION="$FLWR_VERSION" \
    $([[ ${REBUILD:-0} == 1 ]] && echo --no-cache) \
    -v "$WORK/pip.conf:/etc/pip.conf:ro" "${BUILD_MOUNTS[@]}" \
    -t "$IMAGE" . >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }
podman run --rm "$IMAGE" python -c \
  'import flwr, torch, fedsparse.server.app; print("image: flwr", flwr.__version__, "torch", torch.__version__)'

# --- 4. certificates and node keys -------------------------------------------------------
phase certs
deploy/certs/generate.sh "$WORK/certs" "$NODES" >"$WORK/certs.log" 2>&1 ||
  { cat "$WORK/certs.log"; exit 1; }
mkdir -p "$WORK/runs"
chown 49999:49999 "$WORK/runs" # the image's user `app` writes rounds.jsonl there

# --- 5. compose up -----------------------------------------------------------------------
phase up
"$PY" -m fedsparse.lab.launch.compose --nodes "$NODES" --out "$COMPOSE_FILE" \
  --certs "$WORK/certs" --runs "$WORK/runs" --build-context "$ROOT" --image "$IMAGE"
UP=1
"$PODMAN_COMPOSE" -p "$PROJECT" -f "$COMPOSE_FILE" up -d --no-build >"$WORK/up.log" 2>&1 ||
  { cat "$WORK/up.log"; exit 1; }

# --- 6. register the SuperNodes ----------------------------------------------------------
phase register
export FLWR_HOME="$WORK/flwr-home" FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
"$PY" -c 'import sys; from pathlib import Path; from fedsparse.lab.launch.flower import write_flwr_config
write_flwr_config(Path(sys.argv[1]), name="containers", control_port=9093,
                  root_certificates=Path(sys.argv[2]))' "$FLWR_HOME" "$WORK/certs/ca.crt"
FLWR="$VENV/bin/flwr"
deadline=$(($(date +%s) + 120))
for ((i = 0; i < NODES; i++)); do
  until "$FLWR" supernode register "$WORK/certs/nodes/node-$i.pub" containers >"$WORK/register.log" 2>&1; do
    if (($(date +%s) > deadline)); then cat "$WORK/register.log"; exit 1; fi
    sleep 2 # the SuperLink may still be starting
  done
done
until [[ $("$FLWR" supernode list containers 2>/dev/null | grep -c online) -ge $NODES ]]; do
  if (($(date +%s) > deadline)); then "$FLWR" supernode list containers; exit 1; fi
  sleep 2
done
"$FLWR" supernode list containers

# --- 6b. what a SuperNode container can reach -----------------------------------------------
phase isolate
PROBE='import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
try:
    socket.create_connection((host, port), timeout=5).close()
except OSError as err:
    print(f"{host}:{port} unreachable ({err})"); sys.exit(1)
print(f"{host}:{port} reachable")'
probe() { "$PODMAN_COMPOSE" -p "$PROJECT" -f "$COMPOSE_FILE" exec -T supernode-0 python -c "$PROBE" "$@"; }
probe superlink 9092 || { echo "a SuperNode cannot reach the Fleet API" >&2; exit 1; }
for target in "superlink 9093" "10.249.249.2 9093"; do
  # shellcheck disable=SC2086
  if probe $target; then echo "a SuperNode reaches the Control API ($target)" >&2; exit 1; fi
done
if "$PODMAN_COMPOSE" -p "$PROJECT" -f "$COMPOSE_FILE" exec -T supernode-0 test -e /app/certificates/server.key; then
  echo "the SuperLink's key is in a SuperNode container" >&2; exit 1
fi
echo "isolation: Fleet API reachable; Control API and server.key not, from supernode-0"

# --- 7. the run on the containers ---------------------------------------------------------
phase run
APP=$("$PY" -c 'import sys; from pathlib import Path; from fedsparse.lab.launch.flower import app_bundle_dir
print(app_bundle_dir(Path(sys.argv[1])))' "$WORK")
OVERRIDES=()
for kv in "${RUN_CONFIG[@]}"; do # `flwr run` wants TOML values: strings quoted
  value=${kv#*=}
  [[ $value =~ ^(-?[0-9.eE+-]+|true|false)$ ]] || kv="${kv%%=*}=\"$value\""
  OVERRIDES+=(--run-config "$kv")
done
timeout 600 "$FLWR" run "$APP" containers "${OVERRIDES[@]}" --run-config 'out-dir="/runs/deploy"' \
  --stream >"$WORK/flwr-run.log" 2>&1 || { tail -40 "$WORK/flwr-run.log"; exit 1; }
tail -5 "$WORK/flwr-run.log"
[[ -s $WORK/runs/deploy/rounds.jsonl ]] || { echo "no rounds.jsonl from the containers"; exit 1; }

# --- 8. the same run config in simulation ---------------------------------------------------
phase simulate
SETS=()
for kv in "${RUN_CONFIG[@]}"; do SETS+=(--set "$kv"); done
"$VENV/bin/fedsparse" simulate --clients "$NODES" "${SETS[@]}" --out "$WORK/simulate" \
  --timeout 600 >"$WORK/simulate.log" 2>&1 || { tail -40 "$WORK/simulate.log"; exit 1; }

# --- 9. compare ------------------------------------------------------------------------------
phase compare
"$PY" -m fedsparse.lab.launch.compose --compare "$WORK/runs/deploy" "$WORK/simulate"
