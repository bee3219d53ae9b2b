"""A small OTLP receiver for the whole-trace test (tests/process/traces.rs).

Listens on 127.0.0.1:PORT for `POST /v1/traces` (http/protobuf), or with `grpc` for the
OTLP gRPC trace service (needs grpcio), decodes each request with the
`opentelemetry-proto` package and appends one JSON object per span to OUT: service, name,
kind, trace and span ids, parent, links, attributes and status. Prints `listening` once
it accepts requests.

Usage: otlp_receiver.py PORT OUT [http|grpc]
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

OUT = sys.argv[2]


def value(v):
    """An AnyValue as plain JSON."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    if kind is None:
        return None
    return getattr(v, kind)


def attributes(kvs):
    return {kv.key: value(kv.value) for kv in kvs}


def record(request):
    """Appends the spans of an ExportTraceServiceRequest to OUT."""
    lines = []
    for rs in request.resource_spans:
        resource = attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                lines.append(
                    json.dumps(
                        {
                            "service": resource.get("service.name"),
                            "resource": resource,
                            "name": s.name,
                            "kind": Span.SpanKind.Name(s.kind),
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent_span_id": s.parent_span_id.hex(),
                            "links": [
                                {"trace_id": l.trace_id.hex(), "span_id": l.span_id.hex()}
                                for l in s.links
                            ],
                            "attributes": attributes(s.attributes),
                            "status": {
                                "code": Status.StatusCode.Name(s.status.code),
                                "message": s.status.message,
                            },
                        }
                    )
                )
    with open(OUT, "a") as f:
        for line in lines:
            f.write(line + "\n")


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path != "/v1/traces":
            self.send_response(404)
            self.end_headers()
            return
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        record(request)
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


if len(sys.argv) > 3 and sys.argv[3] == "grpc":
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            record(request)
            return ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    server.add_insecure_port(f"127.0.0.1:{sys.argv[1]}")
    server.start()
    print("listening", flush=True)
    server.wait_for_termination()
else:
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    print("listening", flush=True)
    server.serve_forever()
