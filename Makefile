# outbox-relay — every target is listed by `make help`.
.DEFAULT_GOAL := help
CARGO ?= cargo
WITH_PG := scripts/with-postgres.sh

PHASE := scripts/phase.sh
# The tiers run in order, the first failure stopping the rest, even under make -j.
.NOTPARALLEL:

.PHONY: help build check test test-services lint fmt verify run migrate bench bench-peers check-deploy \
	chaos chaos-short schema-check sql-api-doc pin-migrations clean-demo package-check test-count

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-15s %s\n", $$1, $$2}'

build: ## build the relayer (release)
	$(CARGO) build --release

check: ## the first tier, in minutes: pins, links, workflows, fmt, clippy, one build of every test, the unit tests and the Postgres suites
	$(PHASE) guards sh -c 'scripts/pin-migrations.sh --check && scripts/check-doc-links.py && scripts/lint-workflows.sh && scripts/build-deps.sh && scripts/need-nextest.sh'
	$(PHASE) fmt $(CARGO) fmt --all -- --check
	$(PHASE) clippy sh -c '$(CARGO) clippy --all-targets -- -D warnings && $(CARGO) clippy --test chaos -- -D warnings'
	$(PHASE) build sh -c '$(CARGO) nextest run --no-run && $(CARGO) build --test chaos'
	$(PHASE) build-demo $(CARGO) build --profile demo --no-default-features --bin outbox-relay
	$(PHASE) tests-postgres $(WITH_PG) scripts/run-tests.sh check

test: check test-services ## every test: `make check`, then the suites that need brokers, emulators, PgBouncer, shells and the producers' toolchains (started or installed, stopped after; see scripts/test-services.sh)

test-services: ## the second tier alone: tests/process, tests/destinations and the doctests, with their servers
	$(PHASE) tests-services scripts/with-test-services.sh $(WITH_PG) scripts/run-tests.sh services

test-count: ## print how many tests each tier runs
	scripts/run-tests.sh list

lint: ## the guards that need no build (pinned migrations checked, doc links, workflows), fmt, the layers test and clippy with warnings as errors
	scripts/pin-migrations.sh --check
	scripts/check-doc-links.py
	scripts/lint-workflows.sh
	$(CARGO) fmt --all -- --check
	$(CARGO) test --quiet --test model layers
	$(CARGO) clippy --all-targets -- -D warnings
	$(CARGO) clippy --test chaos -- -D warnings

package-check: ## the crate as published: its file list checked, and the packaged copy built in target/ (only the crate itself compiles)
	scripts/package-check.sh

check-deploy: ## validate deploy/kubernetes and the Dockerfile offline (kubernetes-validate)
	scripts/check-deploy.sh

schema-check: ## the SQL contract's guards alone: area files = migrations, pinned checksums, comments, grants, docs/sql-api.md, the previous release's statements
	$(WITH_PG) $(CARGO) test --test database -- schema_contract previous_release

sql-api-doc: ## regenerate docs/sql-api.md from the catalogue of a freshly migrated database
	$(WITH_PG) env UPDATE_SQL_API_DOC=1 $(CARGO) test --test database -- sql_api_reference

pin-migrations: ## pin the SHA-256 of migrations not pinned yet in schema/migrations.sha256 (do it as they land)
	scripts/pin-migrations.sh

fmt: ## format the code
	$(CARGO) fmt --all

verify: test ## the same as make test (which starts with make check)

migrate: ## apply the schema migrations to the database DATABASE_URL names (required: never the server's postgres database by default)
	@[ -n "$${DATABASE_URL:-}" ] || { echo "make migrate: set DATABASE_URL to the database to migrate (make run migrates its own, outbox_demo)" >&2; exit 2; }
	$(CARGO) run --release -- migrate

run: ## relay samples to stdout from a database of its own, outbox_demo (created if missing; Ctrl-C stops)
	$(WITH_PG) scripts/run-local.sh

clean-demo: ## drop the outbox_demo database make run created, and the outbox roles no other database uses
	$(WITH_PG) scripts/clean-demo.sh

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

chaos-short: ## the CI-sized chaos run: kill storm, freezes, a 3-minute held horizon, hostile input (~10 min)
	scripts/chaos.sh --short
