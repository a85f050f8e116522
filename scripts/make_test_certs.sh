#!/usr/bin/env bash
# Makes a private CA and, signed by it, a server certificate (for localhost, 127.0.0.1 and ::1,
# plus any names given) and a client certificate, for trying TLS and mutual TLS by hand:
#
#   scripts/make_test_certs.sh DIR [NAME ...]
#   KV_INDEXER_TLS_CERT=DIR/server.pem KV_INDEXER_TLS_KEY=DIR/server.key \
#     KV_INDEXER_TLS_CLIENT_CA=DIR/ca.pem KV_INDEXER_LISTEN_ADDR=127.0.0.1:50051 kv-indexer-server
#   kv-indexer-ctl --endpoint https://localhost:50051 --indexer-ca DIR/ca.pem \
#     --indexer-client-cert DIR/client.pem --indexer-client-key DIR/client.key health
#
# Not the one-line `openssl req -x509` self-signed certificate: it is marked as a CA
# (basicConstraints CA:TRUE), and rustls refuses a CA certificate as a server's own.
set -euo pipefail
DIR=${1:?usage: scripts/make_test_certs.sh DIR [NAME ...]}
shift
mkdir -p "$DIR"
cd "$DIR"
SAN="DNS:localhost,IP:127.0.0.1,IP:::1"
for name in "$@"; do SAN="$SAN,DNS:$name"; done

openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -days 365 \
  -subj "/CN=kv-indexer test CA" -keyout ca.key -out ca.pem \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  2>/dev/null
leaf() { # leaf NAME CN USAGE [SAN]
  local ext
  ext=$(mktemp)
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature"
    echo "extendedKeyUsage=$3"
    [[ -n "${4:-}" ]] && echo "subjectAltName=$4"
  } >"$ext"
  openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -subj "/CN=$2" \
    -keyout "$1.key" -out "$1.csr" 2>/dev/null
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 365 \
    -extfile "$ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$ext"
}
leaf server localhost serverAuth "$SAN"
leaf client kv-indexer-client clientAuth
echo "made ca.pem, server.pem/.key ($SAN) and client.pem/.key in $DIR"
