// The console in a real browser: Debian's Chromium driven by playwright-core (npm), against
// the real binary and a seeded database that tests/process/console_browser.rs prepares. It
// checks what only a browser shows: every screen loads without a console error (a CSP
// violation is one), a message is found by id and its timeline shown, a cross-site form
// is refused, a dead letter is refused with a wrong token and replayed with the right one,
// a list updates itself after an enqueue, and axe-core finds no serious accessibility
// violation. Screenshots of every screen are saved in SCREENSHOTS.
//
// Environment: CONSOLE (the console's base URL), SOURCE, MESSAGE (a pending id), DEAD (two
// dead-letter ids, comma-separated), TOKEN, SCREENSHOTS (a directory), OUTBOX_RELAY (the
// binary) and DATABASE_URL (for the enqueue), CHROMIUM (the browser's path).
import { createRequire } from "node:module";
import { execFileSync } from "node:child_process";
import { readFileSync, mkdirSync } from "node:fs";

const require = createRequire(process.env.NODE_MODULES + "/");
const { chromium } = require("playwright-core");
const axeSource = readFileSync(require.resolve("axe-core/axe.min.js"), "utf8");

const env = (name) => {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is not set`);
  return v;
};
const base = env("CONSOLE");
const source = env("SOURCE");
const message = env("MESSAGE");
const [dead1, dead2] = env("DEAD").split(",");
const token = env("TOKEN");
const shots = env("SCREENSHOTS");
mkdirSync(shots, { recursive: true });

const failures = [];
const check = (ok, what) => {
  if (!ok) failures.push(what);
  console.log(`${ok ? "ok  " : "FAIL"} ${what}`);
};

const browser = await chromium.launch({
  executablePath: env("CHROMIUM"),
  args: ["--no-sandbox", "--disable-gpu"],
});
const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
const page = await context.newPage();
let errors = [];
page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
page.on("pageerror", (e) => errors.push(String(e)));

const q = `source=${encodeURIComponent(source)}`;
const screens = [
  ["overview", `/?${q}`],
  ["messages", `/messages?${q}`],
  ["message", `/messages/${dead2}?${q}`],
  ["dead-letters", `/dead-letters?${q}`],
  ["replay-preview", `/dead-letters/replay?${q}&id=${dead1}`],
  ["sources", `/sources?${q}`],
  ["destinations", `/destinations?${q}`],
];
for (const [name, path] of screens) {
  errors = [];
  const response = await page.goto(base + path, { waitUntil: "load" });
  await page.waitForTimeout(300);
  check(response.status() === 200, `${name}: 200`);
  check(errors.length === 0, `${name}: no console error ${errors.length ? JSON.stringify(errors) : ""}`);
  // axe-core, evaluated through the driver (not a page script: the CSP allows none).
  await page.evaluate(axeSource);
  const result = await page.evaluate(() =>
    window.axe.run(document, { runOnly: ["wcag2a", "wcag2aa", "best-practice"] }));
  const serious = result.violations.filter((v) => v.impact === "serious" || v.impact === "critical");
  check(serious.length === 0,
    `${name}: no serious accessibility violation ${serious.map((v) => `${v.id}: ${v.nodes.map((n) => n.target).join(" ")}`).join("; ")}`);
  await page.screenshot({ path: `${shots}/${name}.png`, fullPage: true });
}

// Find a message by id from the header's box; its page shows the attempt timeline.
errors = [];
await page.goto(`${base}/?${q}`);
await page.fill("#find-id", dead2);
await Promise.all([page.waitForURL(`**/messages/${dead2}?*`), page.click("form.find button")]);
const timeline = await page.textContent("main");
check(timeline.includes("Attempts") && timeline.includes("FAILED") && timeline.includes("w-fail"),
  "find by id: the message's page with its attempt timeline");
check(errors.length === 0, "find by id: no console error");

// A form on another origin posting the right token: refused by the console.
const other = await context.newPage();
await other.setContent(
  `<form method="post" action="${base}/dead-letters/replay">
     <input name="source" value="${source}"><input name="id" value="${dead1}">
     <input name="actor" value="mallory"><input name="reason" value="x">
     <input name="token" value="${token}"><button>go</button></form>`);
const [crossSite] = await Promise.all([other.waitForNavigation(), other.click("button")]);
check(crossSite.status() === 403, `cross-site form POST refused (${crossSite.status()})`);
await other.close();

// The replay: a wrong token is refused, the right one replays, each through the form.
async function replay(withToken) {
  await page.goto(`${base}/dead-letters?${q}`);
  await page.check(`input[name=id][value="${dead1}"]`);
  await Promise.all([page.waitForURL("**/dead-letters/replay?*"), page.click("form button[type=submit] >> text=Preview")]);
  check((await page.textContent("#replay-count")).includes("1"), "dry run lists the one selected");
  await page.fill("#r-actor", "Browser Suite");
  await page.fill("#r-reason", "replayed from the browser suite");
  await page.fill("#r-token", withToken);
  const [response] = await Promise.all([page.waitForNavigation(), page.click("form.replay button")]);
  return response;
}
errors = [];
let answer = await replay("not-the-admin-token");
check(answer.status() === 403 && (await page.textContent("body")).includes("Replay refused"),
  "replay refused without the right token");
answer = await replay(token);
check(answer.status() === 200 && (await page.textContent("#replay-done")).includes("Replayed 1"),
  "replay with the token");
await page.screenshot({ path: `${shots}/replayed.png`, fullPage: true });
check(errors.filter((e) => !e.includes("403")).length === 0, `replay: no console error ${JSON.stringify(errors)}`);

// Live update: the messages list shows a message enqueued after it loaded, without a reload.
await page.goto(`${base}/messages?${q}`);
const fresh = execFileSync(env("OUTBOX_RELAY"), ["enqueue", "--topic", "live", "--payload", "{\"live\":true}"],
  { env: { ...process.env }, encoding: "utf8" }).trim();
let navigated = false;
page.once("framenavigated", () => { navigated = true; });
try {
  await page.waitForFunction((id) => document.getElementById("live").textContent.includes(id), fresh, { timeout: 20000 });
  check(!navigated, `live update showed ${fresh} without a reload`);
} catch (e) {
  check(false, `live update showed ${fresh}: ${e.message}`);
}
// Paused: a second enqueue does not appear.
await page.click("#pause");
check((await page.getAttribute("#pause", "aria-pressed")) === "true", "pause button pressed");
const later = execFileSync(env("OUTBOX_RELAY"), ["enqueue", "--topic", "live", "--payload", "{}"],
  { env: { ...process.env }, encoding: "utf8" }).trim();
await page.waitForTimeout(3000);
check(!(await page.textContent("#live")).includes(later), "paused: no update");
await page.click("#pause");

await browser.close();
if (failures.length) {
  console.log(`${failures.length} check(s) failed`);
  process.exit(1);
}
console.log("every browser check passed");
