# Builds the relayer; the schema migrations are embedded in the binary.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/outbox-relay /usr/local/bin/outbox-relay
USER nobody
ENTRYPOINT ["outbox-relay"]
CMD ["run"]
