#!/usr/bin/env bash
# make-test-certs.sh DIR: test PKI for the TLS tests of the Kubernetes client. In DIR:
# ca.{crt,key}; server.{crt,key} for 127.0.0.1 and localhost, signed by ca; client.{crt,key}
# (CN meshtrain-operator, client auth), signed by ca; other-ca.{crt,key}, which signed nothing.
set -euo pipefail
dir=$1
mkdir -p "$dir"
cd "$dir"
self_signed() { openssl req -x509 -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.crt" -days 2 -subj "/CN=$2" 2>/dev/null; }
signed() {  # signed NAME COMMON_NAME EXTENSIONS
  openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=$2" 2>/dev/null
  printf '%b\n' "$3" >"$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$1.crt" -days 2 \
    -extfile "$1.ext" 2>/dev/null
}
self_signed ca meshtrain-test-ca
self_signed other-ca meshtrain-other-ca
signed server 127.0.0.1 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth'
signed client meshtrain-operator 'extendedKeyUsage=clientAuth'
