// What the header's badges and the health panel's "snapshots" line say, from what this page has
// heard. Two sources: the scheduler's snapshots, each saying how it was paced (its cadence), and
// the frontend's own view of the scheduler (the link), sent every period whether snapshots come
// or not. A throttled snapshot is not a missing one: under load the scheduler sends fewer (an
// open page may take a few percent of its CPU) and says so; a late snapshot from a scheduler the
// frontend still hears means the scheduler is busy; a scheduler the frontend no longer hears, or
// a lost worker, is an outage and shows red. Pure, so the browser test can call it directly.

import { fmtAge } from "./format.js";

const QUIET_PERIODS = 3; // the stream is stalled after this many periods with no frame

// When a snapshot counts as late: one promised snapshot missed, plus a second of grace for a
// loaded machine (the cadence's max_gap_s is the scheduler's promise; 1 s when it does not say).
function lateAfterS(cadence) {
  return 2 * (cadence?.max_gap_s ?? 1) + 1;
}

const ok = (text, detail = "") => ({ level: "ok", text, detail });
const warn = (text, detail = "") => ({ level: "warn", text, detail });
const bad = (text, detail = "") => ({ level: "bad", text, detail });

// The page's state (see page.js) at time ``now`` (performance.now() milliseconds) as
// {stream, scheduler, worker, snapshots, fresh}: each {level: ok|warn|bad, text, detail}; stream
// is null while frames arrive; ``fresh`` when the latest snapshot still speaks for the worker.
export function pageStatus(state, now) {
  const { link, snapshot, feed, periodS = 1 } = state;
  const quietS = state.frameAt == null ? 0 : (now - state.frameAt) / 1000;
  if (!link) {
    const waiting = warn("…", "waiting for the stream");
    return { stream: null, scheduler: waiting, worker: waiting, snapshots: waiting };
  }
  if (quietS > QUIET_PERIODS * periodS) {
    const why = `this page has heard nothing for ${fmtAge(quietS)}`;
    return {
      stream: bad(`stalled, nothing for ${fmtAge(quietS)}`),
      scheduler: warn("unknown", why),
      worker: warn("unknown", why),
      snapshots: warn(`unknown: ${why}`),
    };
  }
  const ageS = snapshot ? (now - state.snapshotAt) / 1000 : null;
  if (link.state !== "greeted" || link.alive === false) return outage(link, ageS);
  if (!feed) return { stream: null, ...alive(link), snapshots: warn("none: this frontend has no monitor feed") };
  const cadence = snapshot?.cadence;
  const sinceS = ageS ?? (now - (state.liveAt ?? now)) / 1000;
  if (sinceS <= lateAfterS(cadence)) {
    if (!snapshot) return { stream: null, ...alive(link), snapshots: ok("waiting for the first") };
    const worker = fromSnapshot(snapshot.health);
    return { stream: null, scheduler: ok("greeted"), worker, snapshots: paced(cadence), fresh: true };
  }
  return { stream: null, ...late(link, ageS, sinceS) };
}

// The frontend no longer hears the scheduler (or never greeted it): red, and the worker unknown.
function outage(link, ageS) {
  const silent = link.heard_s != null ? ` (silent ${fmtAge(link.heard_s)})` : "";
  const what = link.state === "greeted" || link.state === "connected" ? "not answering" : link.state;
  const last = ageS == null ? "none" : `last ${fmtAge(ageS)} ago`;
  return {
    stream: null,
    scheduler: bad(`${what}${silent}`, link.problem || ""),
    worker: warn("unknown", "the scheduler is not answering this frontend"),
    snapshots: bad(`${last}: the scheduler is ${what}`),
  };
}

// The scheduler answers the frontend: the worker as the frontend last heard (SchedulerInfo).
function alive(link) {
  return { scheduler: ok("greeted"), worker: fromLink(link) };
}

// No snapshot for longer than the scheduler promises, though the frontend still hears it.
function late(link, ageS, sinceS) {
  const frontendS = link.snapshot_age_s;
  const last = ageS == null ? `none in ${fmtAge(sinceS)}` : `last snapshot ${fmtAge(ageS)} ago`;
  if (frontendS != null && frontendS + 1 < sinceS) {
    // The frontend has a newer one: the frames were lost on the way to this page.
    const text = `late: ${last}; the frontend's latest is ${fmtAge(frontendS)} old (this page fell behind)`;
    return { ...alive(link), snapshots: warn(text) };
  }
  const busy = ageS == null ? `busy, no snapshot in ${fmtAge(sinceS)}` : `busy, snapshot ${fmtAge(ageS)} ago`;
  return {
    scheduler: warn(busy, "it answers the frontend but sends no snapshots"),
    worker: fromLink(link),
    snapshots: warn(`throttled: ${last}, scheduler busy`),
  };
}

function paced(cadence) {
  if (!cadence) return ok("live");
  const every = fmtAge(cadence.gap_s || cadence.interval_s);
  if (!cadence.throttled) return ok(`live, one every ${every}`);
  const share = `${(100 * cadence.budget).toFixed(0)}%`;
  return ok(`throttled, one every ${every}: the page may take ${share} of the scheduler's CPU`);
}

function fromSnapshot(health) {
  if (!health) return warn("unknown");
  if (health.worker === "ready") return ok("ready");
  return (health.worker === "lost" ? bad : warn)(health.worker, health.reason);
}

function fromLink(link) {
  if (link.worker_ready === true) return ok("ready", "as the frontend last heard");
  if (link.worker_ready === false) return bad("not ready", link.worker_reason || "");
  return warn("unknown");
}
