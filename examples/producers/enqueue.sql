-- psql: the message commits with the transaction's other writes, or not at all.
BEGIN;
-- UPDATE orders SET state = 'placed' WHERE id = 42;
SELECT outbox.enqueue(
    'orders.placed',
    '{"order_id": 42}'::jsonb,
    p_message_key => 'order-42',
    p_headers => '{"x-tenant": "acme"}'::jsonb
);
COMMIT;
