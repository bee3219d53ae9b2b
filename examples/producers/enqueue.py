# Python (psycopg 3): pass JSON as text and cast it, inside the transaction.
import json
import os

import psycopg

with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
    with conn.transaction():
        # conn.execute("UPDATE orders SET state = 'placed' WHERE id = %s", (42,))
        (outbox_id,) = conn.execute(
            "SELECT outbox.enqueue(%s, %s::jsonb, p_message_key => %s, p_headers => %s::jsonb)",
            ("orders.placed", json.dumps({"order_id": 42}), "order-42", json.dumps({"x-tenant": "acme"})),
        ).fetchone()
    print(outbox_id)
