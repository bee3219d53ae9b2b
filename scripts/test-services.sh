#!/usr/bin/env bash
# What `make test` needs besides Postgres (scripts/with-postgres.sh provides that):
#   - redis-server and nats-server binaries (destination tests start servers of their own);
#   - RabbitMQ answering on 127.0.0.1:5672 (tests put a proxy of their own in front of it);
#   - promtool (a test checks a live /metrics with `promtool check metrics`);
#   - pgbouncer (tests/process/poolers.rs starts PgBouncers of its own; the Debian package's service
#     is not started);
#   - zsh and fish (tests/process/cli.rs completes command lines with each shell's own completion
#     engine: zsh in a pseudo-terminal, fish with `complete -C`);
#   - tansu, a Kafka-protocol broker (Kafka tests start brokers of their own), and kcat, the
#     independent client they read back with;
#   - mosquitto (MQTT tests start brokers of their own) and mosquitto_sub/mosquitto_pub,
#     the independent clients they read back with;
#   - the Google Cloud Pub/Sub emulator and Java 17 (Pub/Sub tests start emulators of their
#     own and read them back with python3's standard library);
#   - what the build needs (scripts/build-deps.sh);
#   - the toolchains and drivers of the README's producer snippets (tests/process/producers.rs): Go
#     and pgx v4 and OpenTelemetry Go (Debian's golang-go, golang-github-jackc-pgx-v4-dev and
#     golang-opentelemetry-otel-dev: the Go module
#     proxy is not reachable from every machine, Debian's packages are), psycopg and the
#     OpenTelemetry Python SDK (the trace context snippet) in a virtual environment at
#     target/venv, and pg and the OpenTelemetry JS SDK (npm) in target/node_modules;
#   - moto in server mode and boto3 in the same virtual environment (the AWS destination
#     tests start moto servers of their own and read back with boto3);
#   - the OpenTelemetry Python SDK, its OTLP/HTTP exporter and opentelemetry-proto there too
#     (the whole-trace test's producer, consumer and OTLP receiver, tests/process/traces.rs).
#   - Debian's chromium, and playwright-core and axe-core (npm) in target/node_modules: the
#     console's browser suite (tests/process/console_browser.rs).
# Starts RabbitMQ, and the machine's Redis (6379), NATS (4222), Mosquitto (1883) and a tansu broker (9092)
# that `make bench` uses, when they are installed but down, and writes what it started to
# target/test-services.started so that scripts/stop-test-services.sh (the end of `make
# test`) stops those and nothing else. Installs with apt-get what Debian packages (each
# announced on stderr with its reason and expected time) and tansu with `cargo install
# --locked` into ~/.cargo/bin (once per machine) when missing; nothing else goes outside
# target/, and no installed package is upgraded (see below).
# Anything still missing fails here, naming the server and the command that provides it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build-deps.sh

mkdir -p "${CARGO_TARGET_DIR:-target}"
target=$(cd "${CARGO_TARGET_DIR:-target}" && pwd)
started="$target/test-services.started"
: >"$started"

TANSU_VERSION=0.6.0
# tansu is compiled once per machine, not once per checkout: `cargo install` puts it in
# cargo's own bin directory (~/.cargo/bin), outside every clone, where the next clone finds
# it. One of the right version a checkout installed under target/tools is used too.
TANSU="${CARGO_HOME:-$HOME/.cargo}/bin/tansu"
if ! "$TANSU" --version 2>/dev/null | grep -q "$TANSU_VERSION" \
    && "$PWD/target/tools/bin/tansu" --version 2>/dev/null | grep -q "$TANSU_VERSION"; then
    TANSU="$PWD/target/tools/bin/tansu"
fi

answers() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
missing=()

if ! answers 5672 && command -v rabbitmq-server >/dev/null 2>&1; then
    echo "test-services: starting RabbitMQ" >&2
    rabbitmq-server -detached && echo rabbitmq >>"$started" || true
fi
if ! answers 6379 && command -v redis-server >/dev/null 2>&1; then
    echo "test-services: starting Redis" >&2
    mkdir -p /var/lib/redis /var/log/redis 2>/dev/null || true
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log --pidfile "$target/redis-6379.pid" \
        && echo "redis $target/redis-6379.pid" >>"$started" || true
fi
if ! answers 4222 && [ -x /usr/sbin/nats-server ]; then
    echo "test-services: starting NATS with JetStream" >&2
    start-stop-daemon --start --oknodo --background --make-pidfile \
        --pidfile "$target/nats-4222.pid" --exec /usr/sbin/nats-server -- \
        -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log \
        && echo "nats $target/nats-4222.pid" >>"$started" || true
fi
if ! answers 1883 && [ -x /usr/sbin/mosquitto ]; then
    # For `make bench --destination mqtt`; the MQTT tests start brokers of their own.
    echo "test-services: starting Mosquitto on 127.0.0.1:1883" >&2
    start-stop-daemon --start --oknodo --background --make-pidfile \
        --pidfile "$target/mosquitto-1883.pid" --exec /usr/sbin/mosquitto -- -p 1883 \
        && echo "mosquitto $target/mosquitto-1883.pid" >>"$started" || true
fi
apt_packages=()
reasons=()
if ! command -v promtool >/dev/null 2>&1; then
    apt_packages+=(prometheus); reasons+=("promtool checks a live /metrics")
fi
if [ ! -x /usr/sbin/pgbouncer ]; then
    apt_packages+=(pgbouncer); reasons+=("tests/process/poolers.rs runs PgBouncers of its own in front of Postgres")
fi
if ! command -v kcat >/dev/null 2>&1; then
    apt_packages+=(kcat); reasons+=("kcat reads back what the Kafka tests published")
fi
if [ ! -x /usr/sbin/mosquitto ]; then
    apt_packages+=(mosquitto); reasons+=("the MQTT tests start Mosquitto brokers of their own")
fi
if ! command -v mosquitto_sub >/dev/null 2>&1; then
    apt_packages+=(mosquitto-clients); reasons+=("mosquitto_sub reads back what the MQTT tests published")
fi
if [ ! -x /usr/bin/chromium ]; then
    apt_packages+=(chromium); reasons+=("the console's browser suite (tests/process/console_browser.rs) drives Chromium")
fi
if ! command -v go >/dev/null 2>&1; then
    apt_packages+=(golang-go); reasons+=("go runs the README's Go producer snippet")
fi
if [ ! -d /usr/share/gocode/src/github.com/jackc/pgx/v4 ] \
    && [ ! -d "$target/debs/root/usr/share/gocode/src/github.com/jackc/pgx/v4" ]; then
    apt_packages+=(golang-github-jackc-pgx-v4-dev)
    reasons+=("pgx v4, the driver of the README's Go producer snippet")
fi
if [ ! -d /usr/share/gocode/src/go.opentelemetry.io/otel/sdk/trace ] \
    && [ ! -d "$target/debs/root/usr/share/gocode/src/go.opentelemetry.io/otel/sdk/trace" ]; then
    apt_packages+=(golang-opentelemetry-otel-dev)
    reasons+=("OpenTelemetry Go, the SDK of the README's Go trace context snippet")
fi
if ! command -v zsh >/dev/null 2>&1; then
    apt_packages+=(zsh); reasons+=("zsh completes command lines with the generated zsh completion script")
fi
if ! command -v fish >/dev/null 2>&1 && [ ! -x "$target/debs/bin/fish" ]; then
    apt_packages+=(fish); reasons+=("fish completes command lines with the generated fish completion script")
fi
if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    apt_packages+=(python3-venv); reasons+=("a virtual environment holds psycopg under $target/")
fi
# A test run never upgrades what the machine already has. Each package is simulated first
# (apt-get -s); those whose install upgrades nothing are installed. For one that would
# upgrade an installed package (the Go driver's packages pull a newer libsystemd0 and
# systemd; fish a newer libpcre2-8-0), what apt would add new is unpacked under
# $target/debs instead (dpkg-deb -x, nothing registered with dpkg) and the upgrade is not
# made: its programs run from $target/debs/bin (scripts/with-test-services.sh puts it first
# in PATH) with their libraries, and Go sources from $target/debs/root/usr/share/gocode.
# Only packages that work unpacked are unpacked (programs under /usr/bin, Go sources); any
# other that would upgrade or remove an installed package is not installed, and the run
# fails below naming it and what its install would change.
debs="$target/debs"
unpackable=" fish zsh kcat prometheus golang-go golang-github-jackc-pgx-v4-dev golang-opentelemetry-otel-dev mosquitto-clients "
# What installing the packages would change of what is installed: upgrades and removals.
upgrades() {
    apt-get -s install --no-install-recommends "$@" 2>/dev/null \
        | awk '/^Inst [^ ]+ \[/ || /^Remv / {print $2}'
}
unpack_locally() { # package: unpack what its install would add, without the upgrades
    local package=$1 new
    new=$(apt-get -s install --no-install-recommends "$package" 2>/dev/null \
        | awk '/^Inst [^ ]+ \(/ {print $2}')
    echo "test-services: $package would upgrade $(upgrades "$package" | tr '\n' ' ')(installed" \
         "packages, left as they are): unpacking $(wc -w <<<"$new") new packages under" \
         "$debs instead (about a minute)" >&2
    mkdir -p "$debs/download" "$debs/root" "$debs/bin"
    # shellcheck disable=SC2086
    if ! (cd "$debs/download" && apt-get download $new >"$debs/download.log" 2>&1); then
        echo "test-services: apt-get download of $package's packages failed:" >&2
        cat "$debs/download.log" >&2
        return 1
    fi
    for deb in "$debs"/download/*.deb; do dpkg-deb -x "$deb" "$debs/root"; done
    rm -rf "$debs/download"
    local libs="$debs/root/usr/lib/x86_64-linux-gnu:$debs/root/lib/x86_64-linux-gnu"
    for program in "$debs"/root/usr/bin/* "$debs"/root/usr/sbin/*; do
        [ -f "$program" ] && [ -x "$program" ] || continue
        local extra=""
        # fish reads its functions and completions from the directory it was built for.
        [ "$(basename "$program")" = fish ] && extra="--init-command 'set -p fish_function_path $debs/root/usr/share/fish/functions; set -p fish_complete_path $debs/root/usr/share/fish/completions'"
        printf '#!/bin/sh\nLD_LIBRARY_PATH="%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "%s" %s "$@"\n' \
            "$libs" "$program" "$extra" >"$debs/bin/$(basename "$program")"
        chmod +x "$debs/bin/$(basename "$program")"
    done
}
export PATH="$debs/bin:$PATH"
if [ ${#apt_packages[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq || true
    clean=()
    clean_reasons=()
    unpacked=()
    for i in "${!apt_packages[@]}"; do
        if [ -z "$(upgrades "${apt_packages[$i]}")" ]; then
            clean+=("${apt_packages[$i]}")
            clean_reasons+=("${reasons[$i]}")
        elif [[ $unpackable == *" ${apt_packages[$i]} "* ]]; then
            echo "test-services: ${apt_packages[$i]}: ${reasons[$i]}" >&2
            unpacked+=("${apt_packages[$i]}")
        else
            echo "test-services: not installing ${apt_packages[$i]} (${reasons[$i]}): it would" \
                 "upgrade or remove $(upgrades "${apt_packages[$i]}" | tr '\n' ' ')on this" \
                 "machine; install it yourself if that is acceptable" >&2
        fi
    done
    if [ ${#clean[@]} -gt 0 ]; then
        echo "test-services: installing ${clean[*]} with apt-get (system packages, none of them" \
             "an upgrade; about 1-3 minutes):" >&2
        printf 'test-services:   - %s\n' "${clean_reasons[@]}" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${clean[@]}" >/dev/null
    fi
    for package in "${unpacked[@]}"; do unpack_locally "$package"; done
fi
if ! "$TANSU" --version 2>/dev/null | grep -q "$TANSU_VERSION"; then
    # The in-memory storage engine is the `dynostore` feature.
    echo "test-services: installing tansu $TANSU_VERSION with cargo install into" \
         "${CARGO_HOME:-$HOME/.cargo}/bin (the Kafka tests' broker; 5-20 minutes of" \
         "compiling, once per machine)" >&2
    echo "test-services: cargo's warnings during it are expected: 'yanked' names crates in" \
         "tansu's own Cargo.lock, which --locked installs as tansu was released and tested;" \
         "'be sure to add ... to your PATH' does not apply, the tests run tansu by its full path" >&2
    cargo install tansu --version "$TANSU_VERSION" --features dynostore --locked
fi
if ! answers 9092 && [ -x "$TANSU" ]; then
    echo "test-services: starting tansu (Kafka protocol) on 127.0.0.1:9092" >&2
    # From an empty directory: tansu reads a `.env` file from where it runs.
    scratch=$(mktemp -d /tmp/tansu.XXXXXX)
    (cd "$scratch" && exec nohup "$TANSU" broker --storage-engine memory://tansu/ \
        --listener-url tcp://127.0.0.1:9092 --advertised-listener-url tcp://127.0.0.1:9092 \
        >"$scratch/tansu.log" 2>&1) &
    echo "tansu $! $scratch" >>"$started"
fi

# The README's producer snippets run with the languages' own drivers (tests/process/producers.rs),
# installed under the target directory, never into the machine's Python or Node.
if [ ! -x "$target/venv/bin/python" ] \
    || ! "$target/venv/bin/python" -c 'import psycopg, opentelemetry.sdk.trace' 2>/dev/null; then
    echo "test-services: installing psycopg and opentelemetry-sdk (PyPI) into the virtual" \
         "environment $target/venv (the Python producer snippets' driver and the trace context" \
         "snippet's SDK; under a minute)" >&2
    [ -x "$target/venv/bin/python" ] || python3 -m venv "$target/venv"
    "$target/venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off \
        'psycopg[binary]' opentelemetry-sdk || true
fi
if [ ! -x "$target/venv/bin/moto_server" ] || ! "$target/venv/bin/python" -c 'import boto3' 2>/dev/null; then
    echo "test-services: installing moto[server] and boto3 (PyPI) into the virtual environment" \
         "$target/venv (the AWS destination tests' server and the client they read back" \
         "with; about a minute)" >&2
    [ -x "$target/venv/bin/python" ] || python3 -m venv "$target/venv"
    "$target/venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off \
        'moto[server]==5.2.5' boto3 || true
fi
if ! "$target/venv/bin/python" -c 'import opentelemetry.sdk, opentelemetry.proto, opentelemetry.exporter.otlp.proto.http, grpc' 2>/dev/null; then
    echo "test-services: installing the OpenTelemetry Python SDK, its OTLP/HTTP exporter and" \
         "opentelemetry-proto and grpcio (PyPI) into the virtual environment $target/venv (the" \
         "whole-trace test's producer, consumer and OTLP receiver, over HTTP and gRPC; under a minute)" >&2
    [ -x "$target/venv/bin/python" ] || python3 -m venv "$target/venv"
    "$target/venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off \
        opentelemetry-sdk opentelemetry-exporter-otlp-proto-http opentelemetry-proto grpcio || true
fi
if command -v npm >/dev/null 2>&1 && { [ ! -d "$target/node_modules/pg" ] \
    || [ ! -d "$target/node_modules/@opentelemetry/sdk-trace-base" ]; }; then
    echo "test-services: installing pg and the OpenTelemetry JS API and SDK (npm) into" \
         "$target/node_modules (the Node producer snippets' driver and the trace context" \
         "snippet's SDK; under a minute)" >&2
    npm install --no-audit --no-fund --prefix "$target" pg @opentelemetry/api \
        @opentelemetry/context-async-hooks @opentelemetry/core @opentelemetry/sdk-trace-base || true
fi

# The console's browser suite (tests/process/console_browser.rs): playwright-core drives the
# machine's Chromium (it downloads no browser of its own), axe-core checks accessibility in
# the page; both pinned, into the target directory beside pg.
if command -v npm >/dev/null 2>&1 && { [ ! -d "$target/node_modules/playwright-core" ] \
        || [ ! -d "$target/node_modules/axe-core" ]; }; then
    echo "test-services: installing playwright-core and axe-core (npm) into" \
         "$target/node_modules (the console's browser suite; under a minute)" >&2
    npm install --no-audit --no-fund --prefix "$target" playwright-core@1.65.1 axe-core@4.14.1 || true
fi

for _ in $(seq 1 60); do answers 5672 && answers 9092 && break; sleep 1; done
answers 5672 || missing+=("RabbitMQ on 127.0.0.1:5672 (apt-get install rabbitmq-server; start: rabbitmq-server -detached)")
command -v redis-server >/dev/null 2>&1 || missing+=("redis-server (apt-get install redis-server)")
[ -x /usr/sbin/nats-server ] || missing+=("/usr/sbin/nats-server (apt-get install nats-server)")
command -v promtool >/dev/null 2>&1 || missing+=("promtool (apt-get install prometheus)")
command -v kcat >/dev/null 2>&1 || missing+=("kcat (apt-get install kcat)")
[ -x /usr/sbin/mosquitto ] || missing+=("/usr/sbin/mosquitto (apt-get install mosquitto)")
command -v mosquitto_sub >/dev/null 2>&1 || missing+=("mosquitto_sub (apt-get install mosquitto-clients)")
[ -x /usr/sbin/pgbouncer ] || missing+=("/usr/sbin/pgbouncer (apt-get install pgbouncer)")
[ -x /usr/bin/chromium ] || missing+=("/usr/bin/chromium (apt-get install chromium)")
[ -d "$target/node_modules/playwright-core" ] && [ -d "$target/node_modules/axe-core" ] \
    || missing+=("playwright-core and axe-core in $target/node_modules (npm install --prefix $target playwright-core@1.65.1 axe-core@4.14.1)")
[ -x "$TANSU" ] || missing+=("tansu (cargo install tansu --version $TANSU_VERSION --features dynostore --locked)")
answers 9092 || missing+=("a Kafka-protocol broker on 127.0.0.1:9092 (tansu broker, see above)")
command -v go >/dev/null 2>&1 || missing+=("go (apt-get install golang-go)")
[ -d /usr/share/gocode/src/github.com/jackc/pgx/v4 ] \
    || [ -d "$target/debs/root/usr/share/gocode/src/github.com/jackc/pgx/v4" ] \
    || missing+=("pgx v4 for Go (apt-get install golang-github-jackc-pgx-v4-dev)")
[ -d /usr/share/gocode/src/go.opentelemetry.io/otel/sdk/trace ] \
    || [ -d "$target/debs/root/usr/share/gocode/src/go.opentelemetry.io/otel/sdk/trace" ] \
    || missing+=("OpenTelemetry Go (apt-get install golang-opentelemetry-otel-dev)")
command -v node >/dev/null 2>&1 || missing+=("node and npm (apt-get install nodejs npm)")
command -v zsh >/dev/null 2>&1 || missing+=("zsh (apt-get install zsh)")
command -v fish >/dev/null 2>&1 || missing+=("fish (apt-get install fish)")
"$target/venv/bin/python" -c 'import psycopg, opentelemetry.sdk.trace' 2>/dev/null \
    || missing+=("psycopg and opentelemetry-sdk in $target/venv (python3 -m venv $target/venv; $target/venv/bin/pip install 'psycopg[binary]' opentelemetry-sdk)")
PUBSUB_EMULATOR="${PUBSUB_EMULATOR_BIN:-/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator}"
[ -x "$PUBSUB_EMULATOR" ] && command -v java >/dev/null 2>&1 \
    || missing+=("the Google Cloud Pub/Sub emulator at $PUBSUB_EMULATOR and Java 17 (apt-get install google-cloud-cli-pubsub-emulator openjdk-17-jre-headless, from Google Cloud's apt repository packages.cloud.google.com/apt; or gcloud components install pubsub-emulator, then PUBSUB_EMULATOR_BIN=<sdk>/platform/pubsub-emulator/bin/cloud-pubsub-emulator)")
[ -x "$target/venv/bin/moto_server" ] && "$target/venv/bin/python" -c 'import boto3' 2>/dev/null \
    || missing+=("moto and boto3 in $target/venv ($target/venv/bin/pip install 'moto[server]==5.2.5' boto3)")
"$target/venv/bin/python" -c 'import opentelemetry.sdk, opentelemetry.proto, opentelemetry.exporter.otlp.proto.http, grpc' 2>/dev/null \
    || missing+=("the OpenTelemetry Python SDK in $target/venv ($target/venv/bin/pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http opentelemetry-proto grpcio)")
[ -d "$target/node_modules/pg" ] || missing+=("pg in $target/node_modules (npm install --prefix $target pg)")
if [ ${#missing[@]} -gt 0 ]; then
    echo "test-services: the tests need:" >&2
    printf '  - %s\n' "${missing[@]}" >&2
    exit 1
fi
