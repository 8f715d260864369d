#!/usr/bin/env bash
# Self-signed CA + SuperLink server certificate for deploy/with-tls.yml (testing only).
# Writes ca.crt, ca.key, server.pem, server.key next to this script.
set -euo pipefail
cd "$(dirname "$0")"
openssl req -x509 -newkey rsa:4096 -sha256 -days 365 -nodes \
  -keyout ca.key -out ca.crt -subj "/CN=fedsparse-ca"
openssl req -newkey rsa:4096 -sha256 -nodes \
  -keyout server.key -out server.csr -subj "/CN=superlink"
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
  -out server.pem -days 365 -sha256 \
  -extfile <(printf "subjectAltName=DNS:superlink,DNS:localhost,IP:127.0.0.1")
rm -f server.csr ca.srl
chmod 644 ca.crt server.pem server.key  # readable by the image's non-root user
