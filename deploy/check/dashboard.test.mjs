// Browser test of levee's admin dashboard: a real gateway (`levee serve`) in front of a
// simulated engine (`levee engine`), under load from this test; Debian's chromium driven by
// playwright-core loads the page, sees its figures move, forces a degradation level from the
// page, returns to automatic, and checks through /admin/state that the gateway followed.
//
// Needs the levee binary (LEVEE_BIN, default target/debug/levee) and chromium
// (CHROMIUM, default /usr/bin/chromium); without them it skips, unless
// LEVEE_REQUIRE_BROWSER=1. LEVEE_SCREENSHOT=path saves a screenshot taken
// under load. All traffic stays on 127.0.0.1; every process started here is stopped.
import { test, after } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { createServer } from "node:net";
import { mkdtempSync, writeFileSync, existsSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, dirname, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { createHash } from "node:crypto";
import { chromium } from "playwright-core";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..");
const LEVEE = process.env.LEVEE_BIN || join(root, "target", "debug", "levee");
const CHROMIUM = process.env.CHROMIUM || "/usr/bin/chromium";
const TOKEN = "dashboard-test-token";
const children = [];
let browser = null;

function freePort() {
  return new Promise((ok, fail) => {
    const s = createServer();
    s.once("error", fail);
    s.listen(0, "127.0.0.1", () => { const p = s.address().port; s.close(() => ok(p)); });
  });
}

function run(args, env = {}) {
  const child = spawn(LEVEE, args, { env: { ...process.env, ...env }, stdio: ["ignore", "ignore", "pipe"] });
  let err = "";
  child.stderr.on("data", (d) => { err = (err + d).slice(-4000); });
  child.lastErr = () => err;
  children.push(child);
  return child;
}

async function waitFor(what, fn, ms = 20000) {
  const until = Date.now() + ms;
  let last;
  while (Date.now() < until) {
    try { if ((last = await fn())) return last; } catch (e) { last = e; }
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`timed out waiting for ${what} (last: ${last})`);
}

after(async () => {
  if (browser) await browser.close().catch(() => {});
  for (const c of children) if (c.exitCode === null) c.kill("SIGTERM");
  await Promise.all(children.map((c) => c.exitCode !== null ? null : new Promise((r) => c.once("exit", r))));
});

test("dashboard follows a loaded gateway and steers its degradation", { timeout: 120000 }, async (t) => {
  // In CI (LEVEE_REQUIRE_BROWSER=1) a missing binary fails the test instead of skipping it.
  for (const [path, how] of [[LEVEE, "cargo build -p levee"], [CHROMIUM, "apt-get install chromium"]]) {
    if (existsSync(path)) continue;
    if (process.env.LEVEE_REQUIRE_BROWSER === "1") assert.fail(`no ${path} (${how})`);
    return t.skip(`no ${path} (${how})`);
  }
  const [enginePort, publicPort, adminPort] = [await freePort(), await freePort(), await freePort()];
  run(["engine", "--port", String(enginePort), "--profile", "tiny-fast", "--model", "m"]);
  const key = "dash-key";
  const dir = mkdtempSync(join(tmpdir(), "levee-dash-"));
  const cfg = join(dir, "levee.toml");
  writeFileSync(cfg, `
[listen]
public = "127.0.0.1:${publicPort}"
admin = "127.0.0.1:${adminPort}"
[scrape]
interval_ms = 500
[[tenants]]
name = "acme"
tier = "standard"
key_sha256 = ["${createHash("sha256").update(key).digest("hex")}"]
requests_per_minute = 100000
[[models]]
name = "m"
[[models.backends]]
url = "http://127.0.0.1:${enginePort}"
max_in_flight = 4
[autoscale]
min_replicas = 1
warm_pool = 0
`);
  const gw = run(["serve", "--config", cfg], { LEVEE_ADMIN_TOKEN: TOKEN });
  const admin = `http://127.0.0.1:${adminPort}`;
  const auth = { authorization: `Bearer ${TOKEN}` };
  const state = async () => (await fetch(`${admin}/admin/state`, { headers: auth })).json();
  await waitFor("the gateway", async () => {
    if (gw.exitCode !== null) throw new Error("levee serve exited: " + gw.lastErr());
    return (await fetch(`http://127.0.0.1:${publicPort}/healthz`)).ok;
  });
  assert.equal((await fetch(`${admin}/admin/state`)).status, 401, "the token is required");

  // Load: 12 clients in closed loops against a backend capped at 4 in flight, so requests
  // queue; client i runs while i < active (the test lowers it to see the page follow), all
  // bounded by the test's timeout.
  let active = 12, sent = 0;
  const client = async (_, i) => {
    while (i < active) {
      sent++;
      await fetch(`http://127.0.0.1:${publicPort}/v1/chat/completions`, {
        method: "POST",
        headers: { "content-type": "application/json", authorization: `Bearer ${key}` },
        body: JSON.stringify({ model: "m", max_tokens: 16, messages: [{ role: "user", content: "hello there" }] }),
      }).then((r) => r.arrayBuffer()).catch(() => {});
    }
  };
  const load = Array.from({ length: 12 }, client);

  try {
    // A fresh profile directory each run (playwright passes it as --user-data-dir).
    browser = await chromium.launchPersistentContext(mkdtempSync(join(tmpdir(), "levee-chromium-")), {
      executablePath: CHROMIUM,
      headless: true,
      args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"],
      viewport: { width: 1400, height: 1100 },
    });
    const page = await browser.newPage();
    const external = [];
    page.on("request", (r) => { if (!r.url().startsWith(admin)) external.push(r.url()); });
    await page.goto(`${admin}/#token=${TOKEN}`);

    // Figures move: in-flight work appears and the admitted rate goes above zero.
    await waitFor("requests in flight on the page", async () => Number(await page.textContent("#inflight")) > 0);
    await waitFor("an admitted rate", async () => Number(await page.textContent('[data-series="rates/admitted"]')) > 0);
    // The limit store in use and its health (this gateway runs on in-memory state).
    assert.equal(await page.textContent("#store"), "in memory");
    // Load is queued + in flight: with 12 clients on 4 slots it goes past 4; with 3 clients
    // left it cannot exceed 3. Both figures come from the gateway as the page polls it.
    await waitFor("a load above the backend's 4 slots", async () => Number(await page.textContent("#load")) > 4);
    active = 3;
    await waitFor("the load figure to follow the clients down", async () => Number(await page.textContent("#load")) <= 3);
    await waitFor("a replica recommendation", async () => (await page.locator("#autoscale td").count()) > 0);

    // Force level 2 from the page; the gateway follows.
    await page.click("#degrade-2");
    await waitFor("the page to show level 2 forced", async () =>
      (await page.textContent("#level")) === "level 2" && (await page.textContent("#level-mode")) === "forced");
    let s = await state();
    assert.equal(s.degradation.level, 2);
    assert.equal(s.degradation.forced, true);
    if (process.env.LEVEE_SCREENSHOT) {
      await page.waitForTimeout(3000); // let the charts gather a few more points for the picture
      await page.screenshot({ path: process.env.LEVEE_SCREENSHOT, fullPage: true });
    }

    // One click back to automatic.
    await page.click("#degrade-auto");
    await waitFor("the page to show automatic", async () => (await page.textContent("#level-mode")) === "automatic");
    s = await state();
    assert.equal(s.degradation.forced, false);
    assert.deepEqual(external, [], "the page loads nothing from elsewhere");
    assert.ok(sent > 0);
  } finally {
    active = 0;
    await Promise.all(load);
  }
});
