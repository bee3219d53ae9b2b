# outbox-relay — every target is listed by `make help`.
.DEFAULT_GOAL := help
CARGO ?= cargo
WITH_PG := scripts/with-postgres.sh

.PHONY: help build test lint fmt verify run migrate bench clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

build: ## build the relayer (release)
	$(CARGO) build --release

test: ## run every test against a real Postgres (started if none answers)
	$(WITH_PG) $(CARGO) test --all-targets

lint: ## cargo fmt --check and clippy with warnings as errors
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

fmt: ## format the code
	$(CARGO) fmt --all

verify: lint test ## lint, then test

migrate: ## apply the schema migrations to DATABASE_URL (or the local Postgres)
	$(WITH_PG) $(CARGO) run --release --quiet -- migrate
