// The queues panel: every running request, then the head of the waiting queue, counts and ids
// only (no text). Hovering a running row outlines its blocks on the pool map.

import { fmtAge, shortId } from "./format.js";
import { ownerColor } from "./pool_map.js";

const $ = (id) => document.getElementById(id);

export function renderQueues(snap, poolMap) {
  $("queue-summary").textContent = `${snap.num_running} running · ${snap.num_waiting} waiting`;
  Object.assign($("queue-summary").dataset, { running: snap.num_running, waiting: snap.num_waiting });
  const rows = snap.requests.map((r, index) => queueRow(r, index, poolMap));
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

function queueRow(r, index, poolMap) {
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
