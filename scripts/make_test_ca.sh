#!/usr/bin/env bash
# Makes the certificates of a TEST deployment of zerod's mutual TLS (tls_cert, tls_key, tls_ca;
# zeroctl --tls-cert/--tls-key/--tls-ca), with openssl only:
#
#   scripts/make_test_ca.sh OUTDIR [NAME...]
#
#   ca.pem ca.key         the world's CA (tls_ca of every zerod, --tls-ca of zeroctl)
#   node.pem node.key     a node's certificate, used as server and as client (tls_cert,
#                         tls_key); its subjectAltName is localhost, 127.0.0.1 and each NAME
#                         (an IP address or a DNS name): the names peers dial this node by
#   client.pem client.key zeroctl's client certificate (client authentication only)
#   other-ca.pem other.pem other.key
#                         a certificate from ANOTHER CA, which zerod must refuse (tests)
#
# An existing OUTDIR/ca.pem and ca.key are reused, so one CA can sign a certificate per node:
# run it once per node with the node's names, moving node.pem and node.key away in between.
# Keys are EC P-256 without a passphrase, mode 0600; certificates last 30 days. For production,
# use your organisation's CA and the same extensions (see README, Operations).
set -euo pipefail

if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
out=$1
shift
command -v openssl >/dev/null || {
  echo "make_test_ca.sh: openssl is not installed (Debian: apt-get install openssl)" >&2
  exit 1
}
mkdir -p "$out"
cd "$out"
umask 077
days=30

newkey() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

# A CA: self-signed, allowed to sign certificates only.
make_ca() { # KEY CERT CN
  newkey "$1"
  openssl req -x509 -new -key "$1" -out "$2" -days "$days" -subj "/CN=$3" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign"
}

# A leaf certificate signed by a CA: KEY CERT CN CA_CERT CA_KEY EXTENDED_KEY_USAGE [SAN]
make_leaf() {
  local ext
  ext=$(mktemp)
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$6"
    [ -z "${7:-}" ] || echo "subjectAltName=$7"
  } >"$ext"
  newkey "$1"
  openssl req -new -key "$1" -subj "/CN=$3" |
    openssl x509 -req -CA "$4" -CAkey "$5" -CAcreateserial -days "$days" -extfile "$ext" \
      -out "$2" 2>/dev/null
  rm -f "$ext"
}

san="DNS:localhost,IP:127.0.0.1"
for name in "$@"; do
  if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then san+=",IP:$name"; else san+=",DNS:$name"; fi
done

if [ ! -f ca.pem ] || [ ! -f ca.key ]; then make_ca ca.key ca.pem "zerod test CA"; fi
make_leaf node.key node.pem "zerod node" ca.pem ca.key "serverAuth,clientAuth" "$san"
make_leaf client.key client.pem "zeroctl" ca.pem ca.key "clientAuth"
make_ca other-ca.key other-ca.pem "another CA"
make_leaf other.key other.pem "zerod node" other-ca.pem other-ca.key "serverAuth,clientAuth" \
  "DNS:localhost,IP:127.0.0.1"
rm -f other-ca.key ./*.srl
chmod 0644 ./*.pem
echo "make_test_ca.sh: wrote ca.pem, node.pem/key ($san), client.pem/key, other.pem/key in $out"
