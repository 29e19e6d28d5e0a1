// The live page: one read-only stream (/page/stream) feeds the pool map, the queues, health,
// the plots and the events; the chat talks to /v1/chat/completions. No build step.

import { Chat } from "./chat.js";
import { PoolMap, drawLedgerBar, legend, ownerColor } from "./pool_map.js";
import { Plots } from "./plots.js";
import { sseEvents } from "./sse.js";

const $ = (id) => document.getElementById(id);
const KEY = "nanoserve-api-key";
const STALE_S = 3; // a snapshot older than this is shown as stale

const page = {
  snapshot: null,
  snapshotAt: 0,
  link: null,
  events: new Map(), // seq -> event, from the scheduler
  local: [], // events seen here (the scheduler's link)
  pending: false,
  frames: 0,
  renders: 0, // how often the page redrew, and its slowest redraw: the browser test reads them
  renderMaxMs: 0,
};
window.nanoservePage = page; // for the browser test and the curious

const poolMap = new PoolMap($("pool-map"), $("tooltip"));
page.poolMap = poolMap;
const plots = new Plots($("plot-grid"));
legend($("legend"));

function auth() {
  const key = sessionStorage.getItem(KEY);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function askForKey(why) {
  $("key-why").textContent = why || "This server wants an API key for its live data and its API.";
  $("key-input").value = "";
  if (!$("key-dialog").open) $("key-dialog").showModal();
}
$("key-button").addEventListener("click", () => askForKey("The key is kept for this tab only."));
$("key-cancel").addEventListener("click", () => $("key-dialog").close());
$("key-form").addEventListener("submit", () => {
  const key = $("key-input").value.trim();
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
  restart();
});

// -- the stream ---------------------------------------------------------------------------------

let controller = null;
let retry = 500;

function restart() {
  controller?.abort();
  connect();
}

async function connect() {
  controller = new AbortController();
  const mine = controller;
  setStream("connecting…");
  try {
    const res = await fetch("/page/stream", { headers: auth(), signal: mine.signal, cache: "no-store" });
    if (res.status === 401) {
      setStream("needs an API key");
      askForKey();
      return;
    }
    if (!res.ok) throw new Error(`${res.status} ${res.statusText}`);
    setStream("live");
    retry = 500;
    for await (const { event, data } of sseEvents(res.body)) onFrame(event, JSON.parse(data));
    throw new Error("the stream ended");
  } catch (error) {
    if (mine.signal.aborted) return;
    setStream(`reconnecting (${error.message})`);
    setTimeout(() => { if (controller === mine) connect(); }, retry);
    retry = Math.min(retry * 2, 5000);
  }
}

function setStream(text) {
  $("stream-state").textContent = `stream: ${text}`;
}

function onFrame(event, data) {
  page.frames++;
  if (event === "hello") {
    plots.reset(data.history);
    onLink(data.link);
    if (!data.feed) $("pool-summary").textContent = "(this frontend has no monitor feed)";
  } else if (event === "stats") {
    plots.push(data.sample);
    onLink(data.link);
  } else if (event === "snapshot") {
    page.snapshot = data;
    page.snapshotAt = performance.now();
    for (const e of data.events) page.events.set(e.seq, e);
    schedule();
  }
}

function onLink(link) {
  const before = page.link;
  page.link = link;
  if (before && before.state !== link.state) {
    local("scheduler", link.state === "greeted" ? "scheduler connected" : `scheduler ${link.state}: ${link.problem || ""}`);
  }
  schedule();
}

function local(kind, text) {
  page.local.push({ time: Date.now() / 1000, kind, text });
  if (page.local.length > 50) page.local.shift();
}

function schedule() {
  if (page.pending) return;
  page.pending = true;
  requestAnimationFrame(() => {
    page.pending = false;
    render();
  });
}

// -- rendering ----------------------------------------------------------------------------------

function render() {
  const started = performance.now();
  draw();
  page.renders++;
  page.renderMaxMs = Math.max(page.renderMaxMs, performance.now() - started);
}

function draw() {
  const snap = page.snapshot;
  const stale = !snap || (performance.now() - page.snapshotAt) / 1000 > STALE_S;
  renderPills(snap, stale);
  renderHealth(snap, stale);
  if (snap) {
    const counts = poolMap.update(snap.pool, snap.requests);
    renderPoolSummary(snap.pool, counts);
    drawLedgerBar($("ledger-bar"), snap.pool, counts);
    renderQueues(snap);
  }
  renderEvents();
}

function renderPills(snap, stale) {
  const worker = $("worker-pill");
  const state = stale ? "unknown" : snap.health.worker;
  worker.textContent = `worker: ${state}`;
  worker.className = `pill ${state === "ready" ? "ok" : state === "lost" ? "bad" : "warn"}`;
  const link = page.link;
  const pill = $("link-pill");
  const ok = link && link.state === "greeted" && !stale;
  pill.textContent = `scheduler: ${link ? (stale && link.state === "greeted" ? "no snapshots" : link.state) : "…"}`;
  pill.className = `pill ${ok ? "ok" : "bad"}`;
  if (snap && snap.health.model_id) $("model").textContent = `${snap.health.model_id} · ${snap.health.device} · ${snap.health.dtype}`;
}

function renderPoolSummary(pool, counts) {
  if (!pool) {
    $("pool-summary").textContent = "(no worker has announced a pool yet)";
    return;
  }
  const [free, cached, held, shared] = counts;
  $("pool-summary").textContent =
    `${pool.num_blocks.toLocaleString()} blocks of ${pool.block_size} tokens · held ${held} · shared ${shared} · ` +
    `cached-free ${cached} · free ${free} · watermark ${pool.watermark_blocks}`;
  const summary = $("pool-summary").dataset;
  Object.assign(summary, { held, shared, cached, free, blocks: pool.num_blocks });
}

function renderHealth(snap, stale) {
  const h = snap?.health;
  const link = page.link;
  const rows = [];
  const add = (term, text, cls = "", testid = "") => rows.push([term, text, cls, testid]);
  add("scheduler", link ? `${link.state}${link.problem ? ` (${link.problem})` : ""}` : "…", link?.problem ? "bad-text" : "ok-text", "scheduler");
  if (h) {
    add("worker", h.worker === "ready" ? "ready" : `${h.worker}: ${h.reason}`, h.worker === "ready" ? "ok-text" : "bad-text", "worker");
    add("restarts", `${h.workers_lost_total} worker(s) lost · ${h.frontends_lost_total} frontend(s) lost`, h.workers_lost_total ? "warn-text" : "", "restarts");
    add("audit", auditText(h.audit), h.audit && !h.audit.ok ? "bad-text" : "", "audit");
    add("steps", `${h.num_steps_total.toLocaleString()} applied · ${h.steps_in_flight} in flight · ${h.num_preemptions_total} preemptions`);
    add("uptime", `${fmtAge(h.uptime_s)} (scheduler)`);
    const share = h.uptime_s > 0 ? (100 * h.monitor_s_total) / h.uptime_s : 0;
    add("this page's cost", `${(h.monitor_s_total * 1000).toFixed(0)} ms of scheduler time (${share.toFixed(2)}%)`);
  }
  if (link) add("pages open", String(link.pages));
  if (stale && snap) add("snapshot", `stale: none for ${((performance.now() - page.snapshotAt) / 1000).toFixed(0)} s`, "bad-text");
  const dl = $("health-list");
  dl.replaceChildren(...rows.flatMap(([term, text, cls, testid]) => {
    const dt = document.createElement("dt");
    dt.textContent = term;
    const dd = document.createElement("dd");
    dd.textContent = text;
    if (cls) dd.className = cls;
    if (testid) dd.dataset.testid = testid;
    return [dt, dd];
  }));
  if (h) dl.dataset.workersLost = String(h.workers_lost_total);
}

function auditText(audit) {
  if (!audit) return "off (run the scheduler with --audit)";
  const when = `${fmtAge(audit.age_s)} ago, ${audit.count.toLocaleString()} audits`;
  if (!audit.ok) return `FAILED in ${(audit.seconds * 1000).toFixed(2)} ms: ${audit.error}`;
  return `passed in ${(audit.seconds * 1000).toFixed(2)} ms, ${when}`;
}

function renderQueues(snap) {
  $("queue-summary").textContent = `${snap.num_running} running · ${snap.num_waiting} waiting`;
  Object.assign($("queue-summary").dataset, { running: snap.num_running, waiting: snap.num_waiting });
  const rows = snap.requests.map((r, index) => queueRow(r, index));
  const shownWaiting = snap.requests.length - snap.num_running;
  if (snap.num_waiting > shownWaiting) {
    const tr = document.createElement("tr");
    const td = document.createElement("td");
    td.colSpan = 10;
    td.textContent = `… and ${snap.num_waiting - shownWaiting} more waiting`;
    tr.append(td);
    rows.push(tr);
  }
  $("queue-table").tBodies[0].replaceChildren(...rows);
}

function queueRow(r, index) {
  const tr = document.createElement("tr");
  tr.className = r.running ? "running" : "waiting";
  tr.dataset.id = r.request_id;
  tr.dataset.state = r.running ? "running" : "waiting";
  const total = r.num_prompt_tokens + r.num_output_tokens;
  const cells = [
    shortId(r.request_id),
    r.running ? "running" : r.num_preemptions ? "waiting (preempted)" : "waiting",
    r.slot ?? "–",
    r.num_blocks,
    progress(r.num_computed / Math.max(1, total), r.num_output_tokens / Math.max(1, r.max_tokens)),
    r.num_computed,
    r.num_cached_tokens ? `${r.num_prompt_tokens} (${r.num_cached_tokens} cached)` : r.num_prompt_tokens,
    `${r.num_output_tokens} / ${r.max_tokens}`,
    r.num_preemptions,
    fmtAge(r.age_s),
  ];
  cells.forEach((value, i) => {
    const td = document.createElement("td");
    if (value instanceof Node) td.append(value);
    else td.textContent = String(value);
    if (i === 0) {
      td.className = "id";
      td.title = r.request_id;
      if (r.running) {
        const swatch = document.createElement("span");
        swatch.className = "swatch";
        swatch.style.background = ownerColor(index);
        td.prepend(swatch);
      }
    }
    tr.append(td);
  });
  if (r.running) {
    tr.addEventListener("mouseenter", () => { poolMap.highlight = index; poolMap.draw(); });
    tr.addEventListener("mouseleave", () => { poolMap.highlight = null; poolMap.draw(); });
  }
  return tr;
}

function progress(computed, output) {
  const bar = document.createElement("span");
  bar.className = "bar";
  bar.title = `K/V computed ${(100 * computed).toFixed(0)}% of its tokens; output ${(100 * output).toFixed(0)}% of max_tokens`;
  const a = document.createElement("b");
  a.style.width = `${Math.min(100, 100 * computed)}%`;
  a.style.height = "50%";
  const b = document.createElement("b");
  b.className = "out";
  b.style.width = `${Math.min(100, 100 * output)}%`;
  b.style.top = "50%";
  bar.append(a, b);
  return bar;
}

function renderEvents() {
  const all = [...page.events.values(), ...page.local].sort((a, b) => b.time - a.time).slice(0, 60);
  const items = all.map((e) => {
    const li = document.createElement("li");
    li.dataset.kind = e.kind;
    const time = document.createElement("time");
    time.textContent = new Date(e.time * 1000).toLocaleTimeString();
    const kind = document.createElement("span");
    kind.className = "kind";
    kind.textContent = e.kind;
    li.append(time, kind, e.text);
    return li;
  });
  $("event-list").replaceChildren(...items);
}

function shortId(id) {
  return id.length > 22 ? `${id.slice(0, 14)}…${id.slice(-6)}` : id;
}

function fmtAge(s) {
  if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
  if (s < 120) return `${s.toFixed(1)} s`;
  if (s < 7200) return `${(s / 60).toFixed(1)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

// Stale snapshots show without waiting for a frame.
setInterval(() => { if (page.snapshot) schedule(); }, 1000);
document.addEventListener("visibilitychange", () => { if (!document.hidden) { plots.redraw(); schedule(); } });
window.addEventListener("resize", () => schedule());

new Chat({
  log: $("chat-log"),
  form: $("chat-form"),
  input: $("chat-input"),
  temperature: $("chat-temperature"),
  maxTokens: $("chat-max-tokens"),
  send: $("chat-send"),
  clear: $("chat-clear"),
  auth,
  onUnauthorized: () => askForKey("The API wants a key for the chat."),
});

connect();
