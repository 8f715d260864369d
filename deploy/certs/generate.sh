#!/usr/bin/env bash
# TLS and SuperNode-authentication material for docker-compose.yml (self-signed: testing only).
#
#   deploy/certs/generate.sh [DIR] [NODES]     # DIR: default next to this script; NODES: 3
#   SUPERLINK_SAN="IP:203.0.113.7,DNS:link.example.org" deploy/certs/generate.sh DIR 0
#                 # a SuperLink on another machine than its nodes: the names they dial go
#                 # into the server certificate; NODES=0: each node host makes its own key
#
# Writes into DIR:
#   ca/ca.key           the CA's private key: 0600 in a 0700 folder, mounted into NO container
#   ca.crt              the CA certificate (SuperNodes and `flwr` trust it)
#   server.pem          SuperLink certificate (SANs: superlink, localhost, 127.0.0.1 and the
#                       SuperLink's control-network address, FEDSPARSE_CONTROL_IP, default
#                       10.249.249.2: its own ServerApp launcher dials the Runtime API there),
#                       and the comma-separated SUPERLINK_SAN entries (IP:... or DNS:...)
#   server.key          its private key, 0600
#   nodes/node-<i>      SuperNode i's authentication key (ECDSA P-384, OpenSSH format), 0600
#   nodes/node-<i>.pub  its public key: `flwr supernode register nodes/node-<i>.pub <conn>`
# The compose file mounts ca.crt, server.pem, server.key and nodes/node-<i> as single files.
# The containers run as uid APP_UID (49999, the image's user `app`): run as root, this
# gives server.key and the node keys to that uid, so they stay 0600 and readable in the
# containers (rootful docker or podman). Rootless podman: `podman unshare chown 49999:49999
# <key>` instead (the container's uid 49999 is a subuid there).
set -euo pipefail
DIR=${1:-$(dirname "$0")}
NODES=${2:-3}
APP_UID=${APP_UID:-49999}
CONTROL_IP=${FEDSPARSE_CONTROL_IP:-10.249.249.2}
EXTRA_SAN=${SUPERLINK_SAN:+,$SUPERLINK_SAN}
umask 077
mkdir -p "$DIR/ca" "$DIR/nodes"
cd "$DIR"
chmod 700 ca nodes

openssl req -x509 -newkey rsa:4096 -sha256 -days 365 -nodes \
  -keyout ca/ca.key -out ca.crt -subj "/CN=fedsparse-ca"
openssl req -newkey rsa:4096 -sha256 -nodes \
  -keyout server.key -out server.csr -subj "/CN=superlink"
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca/ca.key -CAcreateserial \
  -out server.pem -days 365 -sha256 \
  -extfile <(printf "subjectAltName=DNS:superlink,DNS:localhost,IP:127.0.0.1,IP:%s%s" \
    "$CONTROL_IP" "$EXTRA_SAN")
rm -f server.csr ca.srl ca/ca.srl

for ((i = 0; i < NODES; i++)); do
  rm -f "nodes/node-$i" "nodes/node-$i.pub"
  ssh-keygen -q -t ecdsa -b 384 -N "" -C "node-$i" -f "nodes/node-$i"
done

shopt -s nullglob  # NODES=0: no node keys
chmod 600 ca/ca.key server.key nodes/node-*[0-9]
chmod 644 ca.crt server.pem nodes/*.pub
if [[ $(id -u) == 0 ]]; then
  chown "$APP_UID:$APP_UID" server.key nodes/node-*[0-9]
else
  echo "not root: give server.key and nodes/node-<i> to uid $APP_UID yourself" \
    "(sudo chown $APP_UID:$APP_UID ..., or podman unshare chown ... when rootless)" >&2
fi
echo "wrote $(pwd): ca.crt server.pem server.key" \
  "$( ((NODES > 0)) && echo "nodes/node-{0..$((NODES - 1))}[.pub]")" \
  "(CA key in ca/, never mounted)"
