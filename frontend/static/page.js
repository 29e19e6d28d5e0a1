// The live page: one read-only stream (/page/stream) feeds the pool map, the queues, health, the
// plots and the events; the chat talks to /v1/chat/completions. No build step: each concept is
// a module of its own (stream, status, health, queues, events, pool map, plots, chat).

import { Chat } from "./chat.js";
import { Events } from "./events.js";
import { renderHealth, renderPills } from "./health.js";
import { PoolMap, drawLedgerBar, legend } from "./pool_map.js";
import { Plots } from "./plots.js";
import { renderQueues } from "./queues.js";
import { pageStatus } from "./status.js";
import { PageStream, askForKey, auth } from "./stream.js";

const $ = (id) => document.getElementById(id);

const page = {
  snapshot: null, // the latest snapshot, and when it arrived (performance.now())
  snapshotAt: 0,
  link: null, // the frontend's view of the scheduler (hello and every stats frame)
  feed: null, // whether this frontend relays the scheduler's snapshots at all
  periodS: 1, // how often the frontend sends a stats frame
  frameAt: null, // when any frame last arrived, and when the stream went live
  liveAt: null,
  streamText: "connecting…",
  pending: false,
  frames: 0,
  renders: 0, // how often the page redrew, and its slowest redraw: the browser tests read them
  renderMaxMs: 0,
  status: null, // what the badges say now (status.js)
};
window.nanoservePage = page; // for the browser tests and the curious

const poolMap = new PoolMap($("pool-map"), $("tooltip"));
page.poolMap = poolMap;
page.redraw = () => render(); // a test reads the badges and their inputs in one task
const plots = new Plots($("plot-grid"));
const events = new Events($("event-list"));
legend($("legend"));

const stream = new PageStream({
  onFrame,
  onState: (text) => {
    page.streamText = text;
    if (text === "live") page.liveAt = page.frameAt = performance.now();
    schedule();
  },
});

function onFrame(event, data) {
  page.frames++;
  page.frameAt = performance.now();
  if (event === "hello") {
    page.feed = data.feed;
    page.periodS = data.period_s;
    plots.reset(data.history);
    onLink(data.link);
    if (!data.feed) $("pool-summary").textContent = "(this frontend has no monitor feed)";
  } else if (event === "stats") {
    plots.push(data.sample);
    onLink(data.link);
  } else if (event === "snapshot") {
    page.snapshot = data;
    page.snapshotAt = page.frameAt;
    events.fromSnapshot(data.events);
    schedule();
  }
}

function onLink(link) {
  const before = page.link;
  page.link = link;
  if (before && before.state !== link.state) {
    // "connected" after "greeted": the socket is up but the scheduler went silent.
    const state = link.state === "connected" ? "not answering" : link.state;
    events.add("scheduler", link.state === "greeted" ? "scheduler answers" : `scheduler ${state}: ${link.problem || ""}`);
  }
  schedule();
}

function schedule() {
  if (page.pending) return;
  page.pending = true;
  requestAnimationFrame(() => {
    page.pending = false;
    render();
  });
}

function render() {
  const started = performance.now();
  draw(started);
  page.renders++;
  page.renderMaxMs = Math.max(page.renderMaxMs, performance.now() - started);
}

function draw(now) {
  const snap = page.snapshot;
  const status = pageStatus(page, now);
  page.status = status;
  renderPills(status, snap?.health, page.streamText);
  renderHealth(snap, page.link, status);
  if (snap) {
    const counts = poolMap.update(snap.pool, snap.requests);
    renderPoolSummary(snap.pool, counts);
    drawLedgerBar($("ledger-bar"), snap.pool, counts);
    renderQueues(snap, poolMap);
  }
  events.render();
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
  Object.assign($("pool-summary").dataset, { held, shared, cached, free, blocks: pool.num_blocks });
}

// The badges age without a frame: a silent stream or a late snapshot shows within a second.
setInterval(schedule, 1000);
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

stream.connect();
