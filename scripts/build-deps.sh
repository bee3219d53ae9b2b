#!/usr/bin/env bash
# What building the relayer needs besides Rust: the Kafka destination compiles the bundled
# librdkafka (rdkafka-sys) with the system's C toolchain, make, zlib and OpenSSL headers
# (its TLS and SCRAM support). Installs what is missing with apt-get (as root); otherwise
# fails naming the packages.
set -euo pipefail

need=()
command -v make >/dev/null 2>&1 || need+=(make)
command -v gcc >/dev/null 2>&1 || need+=(gcc)
command -v g++ >/dev/null 2>&1 || need+=(g++)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
for package in zlib1g-dev libssl-dev; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" \
        || need+=("$package")
done
[ ${#need[@]} -eq 0 ] && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "build-deps: installing ${need[*]} with apt-get (the Kafka destination compiles the bundled librdkafka with them; about a minute)" >&2
    apt-get update -qq || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
else
    echo "build-deps: building needs ${need[*]} (apt-get install ${need[*]})" >&2
    exit 1
fi
