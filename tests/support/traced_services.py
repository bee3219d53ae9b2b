"""The producer and the consumer of the whole-trace test (tests/process/traces.rs), each
instrumented with the OpenTelemetry Python SDK and exporting to OTEL_EXPORTER_OTLP_ENDPOINT
over http/protobuf.

produce TOPIC PAYLOAD...: in one span "create TOPIC" (kind PRODUCER, service "shop"), one
    transaction enqueues each PAYLOAD with the span's W3C context in its headers (the
    W3C propagator's `traceparent`/`tracestate`); prints `TRACE_ID OUTBOX_ID...`.
consume PORT: an HTTP consumer (service "billing") on 127.0.0.1:PORT that continues the
    context of each request's headers in a span "process TOPIC" (kind CONSUMER) and answers
    503 to the first delivery of a message whose payload holds "fail-once", 204 otherwise.
    Prints `listening` once it accepts requests.
"""

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator


def tracer(service):
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    endpoint = os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    return provider, trace.get_tracer(service)


def produce(topic, payloads):
    import psycopg

    provider, t = tracer("shop")
    with t.start_as_current_span(f"create {topic}", kind=SpanKind.PRODUCER) as span:
        headers = {}
        TraceContextTextMapPropagator().inject(headers)
        ids = []
        with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
            with conn.transaction():
                for payload in payloads:
                    (outbox_id,) = conn.execute(
                        "SELECT outbox.enqueue(%s, %s::jsonb, p_headers => %s::jsonb)",
                        (topic, json.dumps(payload), json.dumps(headers)),
                    ).fetchone()
                    ids.append(str(outbox_id))
        trace_id = format(span.get_span_context().trace_id, "032x")
    provider.shutdown()
    print(trace_id, *ids, flush=True)


def consume(port):
    provider, t = tracer("billing")
    seen = set()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            carrier = {k.lower(): v for k, v in self.headers.items()}
            context = TraceContextTextMapPropagator().extract(carrier)
            topic = carrier.get("outbox-topic", "")
            outbox_id = carrier.get("outbox-id", "")
            with t.start_as_current_span(
                f"process {topic}", context=context, kind=SpanKind.CONSUMER
            ) as span:
                span.set_attribute("messaging.message.id", outbox_id)
                fail = b"fail-once" in body and outbox_id not in seen
                seen.add(outbox_id)
                status = 503 if fail else 204
                span.set_attribute("http.response.status_code", status)
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print("listening", flush=True)
    try:
        server.serve_forever()
    finally:
        provider.shutdown()


if sys.argv[1] == "produce":
    produce(sys.argv[2], [json.loads(p) for p in sys.argv[3:]])
elif sys.argv[1] == "consume":
    consume(int(sys.argv[2]))
else:
    sys.exit(f"unknown mode {sys.argv[1]!r}: produce or consume")
