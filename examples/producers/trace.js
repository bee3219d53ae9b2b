// Node (pg, OpenTelemetry): the current span's context goes into the transaction, one line
// before the enqueue calls, which stay as they are.
const pg = require("pg");
const { context, propagation, trace } = require("@opentelemetry/api");
const { AsyncLocalStorageContextManager } = require("@opentelemetry/context-async-hooks");
const { W3CTraceContextPropagator } = require("@opentelemetry/core");
const { BasicTracerProvider } = require("@opentelemetry/sdk-trace-base");

// your application's SDK set-up
context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
propagation.setGlobalPropagator(new W3CTraceContextPropagator());
trace.setGlobalTracerProvider(new BasicTracerProvider());

trace.getTracer("shop").startActiveSpan("place order", async (span) => {
  const client = new pg.Client({ connectionString: process.env.DATABASE_URL });
  await client.connect();
  try {
    await client.query("BEGIN");
    const carrier = {};
    propagation.inject(context.active(), carrier); // the current span's traceparent and tracestate
    await client.query(
      "SELECT set_config('outbox.traceparent', $1, true), set_config('outbox.tracestate', $2, true)",
      [carrier.traceparent ?? "", carrier.tracestate ?? ""],
    );
    const { rows } = await client.query(
      "SELECT outbox.enqueue($1, $2::jsonb, p_message_key => $3) AS id",
      ["orders.placed", JSON.stringify({ order_id: 42 }), "order-42"],
    );
    await client.query("COMMIT");
    console.log(rows[0].id, carrier.traceparent);
  } catch (e) {
    await client.query("ROLLBACK");
    throw e;
  } finally {
    await client.end();
    span.end();
  }
});
