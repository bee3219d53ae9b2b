# Python (psycopg 3, OpenTelemetry): the current span's context goes into the transaction,
# one line before the enqueue calls, which stay as they are.
import json
import os

import psycopg
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider

trace.set_tracer_provider(TracerProvider())  # your application's SDK set-up

with trace.get_tracer("shop").start_as_current_span("place order"):
    with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
        with conn.transaction():
            carrier = {}
            propagate.inject(carrier)  # the current span's traceparent and tracestate
            conn.execute(
                "SELECT set_config('outbox.traceparent', %s, true), set_config('outbox.tracestate', %s, true)",
                (carrier.get("traceparent", ""), carrier.get("tracestate", "")),
            )
            (outbox_id,) = conn.execute(
                "SELECT outbox.enqueue(%s, %s::jsonb, p_message_key => %s)",
                ("orders.placed", json.dumps({"order_id": 42}), "order-42"),
            ).fetchone()
    print(outbox_id, carrier["traceparent"])
