// Node (pg): one client, BEGIN ... COMMIT around your writes and the enqueue.
const pg = require("pg");

(async () => {
  const client = new pg.Client({ connectionString: process.env.DATABASE_URL });
  await client.connect();
  try {
    await client.query("BEGIN");
    // await client.query("UPDATE orders SET state = 'placed' WHERE id = $1", [42]);
    const { rows } = await client.query(
      "SELECT outbox.enqueue($1, $2::jsonb, p_message_key => $3, p_headers => $4::jsonb) AS id",
      ["orders.placed", JSON.stringify({ order_id: 42 }), "order-42", JSON.stringify({ "x-tenant": "acme" })],
    );
    await client.query("COMMIT");
    console.log(rows[0].id);
  } catch (e) {
    await client.query("ROLLBACK");
    throw e;
  } finally {
    await client.end();
  }
})();
