// The header's badges and the health panel: the scheduler and the worker as this page knows them
// (status.js decides what is true), the feed's pacing, the audit, and the worker's plan.

import { fmtAge, terms } from "./format.js";

const $ = (id) => document.getElementById(id);
const TEXT_CLASS = { ok: "ok-text", warn: "warn-text", bad: "bad-text" };

// The worker plan's keys as the page names them; keys not listed here show as they come.
const PLAN_LABELS = { kv_dtype: "K/V dtype", dtype: "dtype", decode: "decode path" };

export function renderPills(status, health, stream) {
  pill($("worker-pill"), "worker", status.worker);
  pill($("link-pill"), "scheduler", status.scheduler);
  if (health?.model_id) $("model").textContent = `${health.model_id} · ${health.device} · ${health.dtype}`;
  // The connection's own word ("live", "reconnecting (…)"), unless a live stream went quiet.
  const stalled = stream === "live" ? status.stream : null;
  $("stream-state").textContent = `stream: ${stalled ? stalled.text : stream}`;
  $("stream-state").className = stalled || stream.startsWith("reconnecting") ? "bad-text" : "muted";
}

function pill(element, name, entry) {
  element.textContent = `${name}: ${entry.text}`;
  element.className = `pill ${entry.level}`;
  element.title = entry.detail;
  element.dataset.level = entry.level;
}

export function renderHealth(snap, link, status) {
  const h = snap?.health;
  const rows = [];
  const add = (term, text, cls = "", testid = "") => rows.push([term, text, cls, testid ? { testid } : {}]);
  const problem = link?.problem ? ` (${link.problem})` : "";
  add("scheduler", `${status.scheduler.text}${problem}`, problem ? "bad-text" : TEXT_CLASS[status.scheduler.level], "scheduler");
  if (h && status.fresh) { // the snapshot still speaks for the worker; else status.js's view does
    add("worker", h.worker === "ready" ? "ready" : `${h.worker}: ${h.reason}`, h.worker === "ready" ? "ok-text" : "bad-text", "worker");
  } else {
    const w = status.worker;
    add("worker", w.detail ? `${w.text} (${w.detail})` : w.text, TEXT_CLASS[w.level], "worker");
  }
  add("snapshots", status.snapshots.text, TEXT_CLASS[status.snapshots.level], "snapshots");
  if (h) {
    add("restarts", `${h.workers_lost_total} worker(s) lost · ${h.frontends_lost_total} frontend(s) lost`, h.workers_lost_total ? "warn-text" : "", "restarts");
    add("audit", auditText(h.audit), h.audit && !h.audit.ok ? "bad-text" : "", "audit");
    add("steps", `${h.num_steps_total.toLocaleString()} applied · ${h.steps_in_flight} in flight · ${h.num_preemptions_total} preemptions`);
    add("uptime", `${fmtAge(h.uptime_s)} (scheduler)`);
    const share = h.uptime_s > 0 ? (100 * h.monitor_s_total) / h.uptime_s : 0;
    add("this page's cost", `${(h.monitor_s_total * 1000).toFixed(0)} ms of scheduler time (${share.toFixed(2)}%)`);
  }
  if (link) add("pages open", String(link.pages));
  if (link?.frontend) add("frontend", `${link.frontend}: tokens/s and latencies are its own`, "", "frontend");
  const dl = $("health-list");
  dl.replaceChildren(...terms(rows));
  if (h) dl.dataset.workersLost = String(h.workers_lost_total);
  renderPlan(h?.plan);
}

// One line per key of the plan the worker announced (how it runs its steps).
function renderPlan(plan) {
  const entries = Object.entries(plan || {});
  $("plan").hidden = entries.length === 0;
  $("plan-list").replaceChildren(...terms(entries.map(([key, value]) => [PLAN_LABELS[key] || key, value, "", { key }])));
}

function auditText(audit) {
  if (!audit) return "off (run the scheduler with --audit)";
  const when = `${fmtAge(audit.age_s)} ago, ${audit.count.toLocaleString()} audits`;
  if (!audit.ok) return `FAILED in ${(audit.seconds * 1000).toFixed(2)} ms: ${audit.error}`;
  return `passed in ${(audit.seconds * 1000).toFixed(2)} ms, ${when}`;
}
