# syntax=docker/dockerfile:1
# outbox-relay: build with the Rust toolchain, run on a distroless base (glibc, CA
# certificates, no shell, no package manager) as a numeric non-root user, so Kubernetes'
# runAsNonRoot accepts it. The schema migrations are embedded in the binary.
#   docker build -t outbox-relay:0.1.0 .
#   docker run --rm -e DATABASE_URL=postgres://… -p 9187:9187 outbox-relay:0.1.0

FROM rust:1.95-bookworm AS build
WORKDIR /src
# Dependencies first, in their own layer, so a source change does not rebuild them.
COPY Cargo.toml Cargo.lock build.rs ./
RUN mkdir -p src/bin/outbox-relay && echo 'fn main() {}' > src/bin/outbox-relay/main.rs \
    && touch src/lib.rs \
    && mkdir schema && cargo build --release --locked \
    && rm -rf src schema
COPY schema schema
COPY src src
RUN touch src/bin/outbox-relay/main.rs src/lib.rs build.rs && cargo build --release --locked \
    && strip target/release/outbox-relay

FROM gcr.io/distroless/cc-debian12:nonroot
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="outbox-relay" \
      org.opencontainers.image.description="Postgres transactional-outbox relayer with fenced leases and an append-only attempt log" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /src/target/release/outbox-relay /usr/local/bin/outbox-relay
# The telemetry listener must be reachable from outside the container (probes, scrapes).
ENV OUTBOX_TELEMETRY_ADDR=0.0.0.0:9187
EXPOSE 9187
USER 65532:65532
# /healthz answers from process start and never depends on the database.
HEALTHCHECK --interval=10s --timeout=5s --start-period=5s --retries=3 \
    CMD ["/usr/local/bin/outbox-relay", "healthcheck"]
ENTRYPOINT ["/usr/local/bin/outbox-relay"]
CMD ["run"]
