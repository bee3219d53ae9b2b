// Go (pgx v4; with v5 only the import path changes): the enqueue inside tx; Rollback
// after Commit is a no-op.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/jackc/pgx/v4"
)

func main() {
	ctx := context.Background()
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
	// tx.Exec(ctx, "UPDATE orders SET state = 'placed' WHERE id = $1", 42)
	var id string
	err = tx.QueryRow(ctx,
		"SELECT outbox.enqueue($1, $2::jsonb, p_message_key => $3, p_headers => $4::jsonb)::text",
		"orders.placed", `{"order_id": 42}`, "order-42", `{"x-tenant": "acme"}`).Scan(&id)
	if err != nil {
		panic(err)
	}
	if err := tx.Commit(ctx); err != nil {
		panic(err)
	}
	fmt.Println(id)
}
