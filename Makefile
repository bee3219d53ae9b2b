# outbox-relay — every target is listed by `make help`.
.DEFAULT_GOAL := help
CARGO ?= cargo
WITH_PG := scripts/with-postgres.sh

.PHONY: help build test lint fmt verify run migrate bench bench-peers check-deploy chaos chaos-short

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

build: ## build the relayer (release)
	$(CARGO) build --release

test: ## run every test against a real Postgres and brokers (started if down; see scripts/test-services.sh)
	scripts/test-services.sh
	$(WITH_PG) $(CARGO) test --all-targets
	$(CARGO) test --doc

lint: ## cargo fmt --check, clippy with warnings as errors, and no import cycle between modules
	$(CARGO) fmt --all -- --check
	$(CARGO) test --quiet --test layers
	$(CARGO) clippy --all-targets -- -D warnings
	$(CARGO) clippy --test chaos -- -D warnings

check-deploy: ## validate deploy/kubernetes and the Dockerfile offline (kubernetes-validate)
	scripts/check-deploy.sh

fmt: ## format the code
	$(CARGO) fmt --all

verify: lint test ## lint, then test

migrate: ## apply the schema migrations to DATABASE_URL (or the local Postgres)
	$(WITH_PG) $(CARGO) run --release --quiet -- migrate

run: ## migrate the local Postgres, enqueue samples, relay them to stdout (Ctrl-C stops)
	$(WITH_PG) scripts/run-local.sh

BENCH_ARGS ?=
bench: ## benchmark drain throughput, backlog flatness, latency and memory (BENCH_ARGS=...)
	$(CARGO) build --release
	$(WITH_PG) target/release/outbox-relay bench $(BENCH_ARGS)

PEERS_ARGS ?=
bench-peers: ## the relayer against graphile-worker, pg-boss and pgmq, then its own shapes (~25 min; PEERS_ARGS=--quick ...)
	scripts/bench-peers.sh $(PEERS_ARGS)

CHAOS_ARGS ?=
chaos: ## fault injection: kills, restarts, freezes, outages, hostile input (~20 min; CHAOS_ARGS=...)
	scripts/chaos.sh $(CHAOS_ARGS)

chaos-short: ## the CI-sized chaos run: kill storm, freeze and hostile input (~2 min)
	scripts/chaos.sh --short
