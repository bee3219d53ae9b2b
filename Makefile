# outbox-relay — every target is listed by `make help`.
.DEFAULT_GOAL := help
CARGO ?= cargo
WITH_PG := scripts/with-postgres.sh

.PHONY: help build test lint fmt verify run migrate bench bench-peers check-deploy chaos chaos-short \
	schema-check sql-api-doc pin-migrations clean-demo package-check

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-15s %s\n", $$1, $$2}'

build: ## build the relayer (release)
	$(CARGO) build --release

test: ## run every test against a real Postgres and brokers (started if down, stopped after; see scripts/test-services.sh)
	scripts/with-test-services.sh sh -c '$(WITH_PG) $(CARGO) test --all-targets && $(CARGO) test --doc'

lint: ## cargo fmt --check, clippy with warnings as errors, no import cycle between modules, every migration pinned, workflows (actionlint), links of README.md and docs/
	scripts/pin-migrations.sh --check
	scripts/check-doc-links.py
	$(CARGO) fmt --all -- --check
	$(CARGO) test --quiet --test layers
	$(CARGO) clippy --all-targets -- -D warnings
	$(CARGO) clippy --test chaos -- -D warnings
	scripts/lint-workflows.sh

package-check: ## cargo publish --dry-run: the crate packages and builds from what it ships
	# A target directory of its own: the verification build would otherwise overwrite
	# target/debug/outbox-relay, which the tests run, with the packaged copy's.
	$(CARGO) publish --dry-run --locked --allow-dirty --target-dir target/package-check

check-deploy: ## validate deploy/kubernetes and the Dockerfile offline (kubernetes-validate)
	scripts/check-deploy.sh

schema-check: ## the SQL contract's guards alone: area files = migrations, pinned checksums, comments, grants, docs/sql-api.md
	$(WITH_PG) $(CARGO) test --test schema_contract

sql-api-doc: ## regenerate docs/sql-api.md from the catalogue of a freshly migrated database
	$(WITH_PG) env UPDATE_SQL_API_DOC=1 $(CARGO) test --test schema_contract -- sql_api_reference

pin-migrations: ## pin the SHA-256 of migrations not pinned yet in schema/migrations.sha256 (do it as they land)
	scripts/pin-migrations.sh

fmt: ## format the code
	$(CARGO) fmt --all

verify: lint test ## lint, then test

migrate: ## apply the schema migrations to DATABASE_URL (or the local Postgres)
	$(WITH_PG) $(CARGO) run --release -- migrate

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

chaos-short: ## the CI-sized chaos run: kill storm, freezes, a 10-minute held horizon, hostile input (~15 min)
	scripts/chaos.sh --short
