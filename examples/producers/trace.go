// Go (pgx v4, OpenTelemetry): the current span's context goes into the transaction, one
// line before the enqueue calls, which stay as they are.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/jackc/pgx/v4"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

func main() {
	// your application's SDK set-up
	otel.SetTracerProvider(sdktrace.NewTracerProvider())
	otel.SetTextMapPropagator(propagation.TraceContext{})

	ctx, span := otel.Tracer("shop").Start(context.Background(), "place order")
	defer span.End()
	conn, err := pgx.Connect(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer conn.Close(ctx)
	tx, err := conn.Begin(ctx)
	if err != nil {
		panic(err)
	}
	defer tx.Rollback(ctx)
	carrier := propagation.HeaderCarrier{}
	otel.GetTextMapPropagator().Inject(ctx, carrier) // the current span's traceparent and tracestate
	_, err = tx.Exec(ctx,
		"SELECT set_config('outbox.traceparent', $1, true), set_config('outbox.tracestate', $2, true)",
		carrier.Get("traceparent"), carrier.Get("tracestate"))
	if err != nil {
		panic(err)
	}
	var id string
	err = tx.QueryRow(ctx, "SELECT outbox.enqueue($1, $2::jsonb, p_message_key => $3)::text",
		"orders.placed", `{"order_id": 42}`, "order-42").Scan(&id)
	if err != nil {
		panic(err)
	}
	if err := tx.Commit(ctx); err != nil {
		panic(err)
	}
	fmt.Println(id, carrier.Get("traceparent"))
}
