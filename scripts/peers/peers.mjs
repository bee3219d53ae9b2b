// The Node peers of `outbox-relay bench --peers`: graphile-worker and pg-boss, each with
// a no-op handler. The bench drives this script and does the timing:
//
//   node peers.mjs setup PEER URL N   installs the peer's schema, enqueues N jobs whose
//                                     payload is 256 bytes of JSON, and exits;
//   node peers.mjs work PEER URL      connects, prints "ready", waits for a line on stdin,
//                                     then starts the peer's worker and prints how many jobs each
//                                     handler call finished (one number per line) until
//                                     stdin closes.
//
// The packages are resolved from PEERS_DIR/node_modules (scripts/bench-peers.sh installs
// them there), so the project itself has no Node dependencies.
import { createRequire } from "node:module";
import path from "node:path";
import readline from "node:readline";

const require = createRequire(path.join(process.env.PEERS_DIR ?? process.cwd(), "package.json"));
const [verb, peer, url, n] = process.argv.slice(2);
const QUEUE = "noop";
const BATCH = Number(process.env.PEERS_BATCH ?? 500);
// {"pad":"…"} with 246 pad characters is 256 bytes.
const payload = () => ({ pad: "x".repeat(246) });

function stdinLines() {
  return readline.createInterface({ input: process.stdin })[Symbol.asyncIterator]();
}

// graphile-worker in its batched mode, with the settings of its own performance page:
// 24 concurrent jobs, a local queue of 500, completions batched.
const graphile = {
  async setup(total) {
    const { runMigrations, makeWorkerUtils } = require("graphile-worker");
    await runMigrations({ connectionString: url });
    const utils = await makeWorkerUtils({ connectionString: url });
    for (let done = 0; done < total; done += 10_000) {
      const size = Math.min(10_000, total - done);
      await utils.addJobs(Array.from({ length: size }, () => ({ identifier: QUEUE, payload: payload() })));
    }
    await utils.release();
  },
  async prepare() {
    const { run } = require("graphile-worker");
    return (onBatch) => this.start(run, onBatch);
  },
  async start(run, onBatch) {
    const runner = await run({
      noHandleSignals: true,
      logger: quietGraphileLogger(),
      preset: {
        worker: {
          connectionString: url,
          concurrentJobs: 24,
          maxPoolSize: 25,
          pollInterval: 100,
          localQueue: { size: BATCH },
          completeJobBatchDelay: 0,
          failJobBatchDelay: 0,
        },
      },
      taskList: {
        [QUEUE]: async () => onBatch(1),
      },
    });
    return () => runner.stop();
  },
};

function quietGraphileLogger() {
  const { Logger } = require("graphile-worker");
  return new Logger(() => (level, message) => {
    if (level === "error") console.error(message);
  });
}

// pg-boss with batched fetches: each of 4 local workers fetches `BATCH` jobs at a time and
// keeps fetching while batches come back full.
const pgboss = {
  async boss(extra) {
    const { PgBoss } = require("pg-boss");
    const boss = new PgBoss({ connectionString: url, max: 6, schedule: false, supervise: false, ...extra });
    boss.on("error", (e) => console.error(e));
    await boss.start();
    return boss;
  },
  async setup(total) {
    const boss = await this.boss({ migrate: true });
    await boss.createQueue(QUEUE);
    for (let done = 0; done < total; done += 10_000) {
      const size = Math.min(10_000, total - done);
      await boss.insert(QUEUE, Array.from({ length: size }, () => ({ data: payload() })));
    }
    await boss.stop({ graceful: false });
  },
  async prepare() {
    const boss = await this.boss({ migrate: false });
    return async (onBatch) => {
      await boss.work(
        QUEUE,
        { batchSize: BATCH, localConcurrency: 4, pollingIntervalSeconds: 0.5, burstWhenBatchFull: true },
        async (jobs) => onBatch(jobs.length),
      );
      return () => boss.stop({ graceful: false, wait: true });
    };
  },
};

const peers = { "graphile-worker": graphile, "pg-boss": pgboss };
const chosen = peers[peer];
if (!chosen || !url || (verb === "setup" && !(Number(n) > 0)) || !["setup", "work"].includes(verb)) {
  console.error("usage: node peers.mjs setup (graphile-worker|pg-boss) URL N | work (graphile-worker|pg-boss) URL");
  process.exit(2);
}

if (verb === "setup") {
  await chosen.setup(Number(n));
} else {
  const lines = stdinLines();
  // Finished jobs are reported in chunks so that the pipe carries a few hundred lines.
  let pending = 0;
  const flush = () => {
    if (pending > 0) {
      process.stdout.write(`${pending}\n`);
      pending = 0;
    }
  };
  const timer = setInterval(flush, 20);
  const start = await chosen.prepare();
  console.log("ready");
  await lines.next();
  const stop = await start((k) => {
    pending += k;
  });
  await lines.next();
  clearInterval(timer);
  flush();
  await stop();
}
process.exit(0);
