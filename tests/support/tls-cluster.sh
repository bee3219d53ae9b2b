#!/usr/bin/env bash
# Starts a throwaway Postgres that accepts TLS connections only, for tests/process/postgres_tls.rs.
#   tls-cluster.sh DIR PORT OWNER_PID
# Writes into DIR: ca.crt (the trusted CA), other-ca.crt (a CA the server does not use),
# client.crt/client.key (user certuser, signed by ca.crt). The server's certificate names
# DNS:localhost only, so 127.0.0.1 is a "wrong host name" for verify-full. pg_hba.conf has
# hostssl lines only: certuser must present a client certificate, pwuser a password
# ("right-password"), everyone else is trusted. A watcher stops the cluster and removes DIR
# when OWNER_PID (the test process) exits.
set -euo pipefail
dir=$1 port=$2 owner=$3
bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
[ -n "$bindir" ] || { echo "tls-cluster: no Postgres binaries under /usr/lib/postgresql" >&2; exit 1; }
if ! command -v openssl >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "tls-cluster: installing openssl with apt-get (it makes the test CA and certificates; seconds)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl >/dev/null
fi
command -v openssl >/dev/null || { echo "tls-cluster: openssl is not installed" >&2; exit 1; }
as_owner=()
if [ "$(id -u)" = 0 ]; then as_owner=(runuser -u postgres --); fi

mkdir -p "$dir"
cd "$dir"
ssl() { openssl "$@" 2>/dev/null; }
ssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=outbox test CA" -keyout ca.key -out ca.crt
ssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=unrelated CA" -keyout other-ca.key -out other-ca.crt
ssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout server.key -out server.csr
printf 'subjectAltName=DNS:localhost\n' > server.ext
ssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile server.ext -out server.crt
ssl req -newkey rsa:2048 -nodes -subj "/CN=certuser" -keyout client.key -out client.csr
printf 'extendedKeyUsage=clientAuth\n' > client.ext # any extension makes it X.509 v3, which rustls needs
ssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile client.ext -out client.crt
chmod 600 server.key client.key
[ "$(id -u)" = 0 ] && chown -R postgres "$dir"

"${as_owner[@]}" "$bindir/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 >/dev/null
cat > "$dir/data/pg_hba.conf" <<HBA
local   all all                    trust
hostssl all certuser 127.0.0.1/32  cert
hostssl all pwuser   127.0.0.1/32  scram-sha-256
hostssl all all      127.0.0.1/32  trust
HBA
"${as_owner[@]}" "$bindir/pg_ctl" -D "$dir/data" -l "$dir/postgres.log" -w -o "-p $port -k $dir \
    -c listen_addresses=127.0.0.1 -c max_connections=100 -c fsync=off -c ssl=on \
    -c ssl_cert_file=$dir/server.crt -c ssl_key_file=$dir/server.key -c ssl_ca_file=$dir/ca.crt" \
    start >/dev/null
"${as_owner[@]}" psql -q -h "$dir" -p "$port" -U postgres -d postgres -v ON_ERROR_STOP=1 \
    -c "CREATE ROLE certuser LOGIN SUPERUSER" \
    -c "CREATE ROLE pwuser LOGIN SUPERUSER PASSWORD 'right-password'"

# Stop the cluster once the test process is gone, whatever way it ended.
nohup bash -c "while kill -0 $owner 2>/dev/null; do sleep 1; done
    ${as_owner[*]} $bindir/pg_ctl -D $dir/data -m immediate stop >/dev/null 2>&1
    rm -rf $dir" >/dev/null 2>&1 &
