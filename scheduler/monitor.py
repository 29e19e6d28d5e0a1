"""Monitor: the scheduler's feed for the web page, published only while someone watches.

It owns an XPUB socket. Frontends subscribe while a browser has the page open; the XPUB tells us
when the first subscription comes and the last goes, so a server nobody watches builds nothing.
While watched, ``maybe_publish`` sends one ``PoolSnapshot`` at most every ``interval_s``, and
less often when the scheduler has little else to do: the snapshots' CPU time since the page
opened stays under ``budget`` of the scheduler's own (planning and applying), except that a page
hears at least every ``max_gap_s``. So an open page costs the scheduler a bounded share of its
work at any load. Each snapshot says how it was paced (``Cadence``: the bounds, the gap since
the last one, whether the budget held it back), so a page can tell a throttled feed from a
missing one.
A snapshot is built only while the loop would otherwise wait (for a step's result, or for
work), so it never holds a step back. Sends never block: a PUB socket drops
what a slow subscriber cannot take, so no subscriber can slow the scheduler.

Events (a worker lost or back, preemptions, a frontend lost, a failed audit) are found by
comparing the counters with the last snapshot's, so no other code reports to this one.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import msgspec
import zmq

from protocol.monitor import AuditRecord, Cadence, Health, MonitorEvent, PoolSnapshot
from scheduler.frontend_side import FrontendSide
from scheduler.snapshot import pool_states, request_rows
from scheduler.worker_side import WorkerSide

log = logging.getLogger("nanoserve.scheduler")

EVENTS_SENT = 16  # the latest events ride along with every snapshot (a page may miss frames)


class Monitor:
    """The XPUB socket, who watches, and the snapshots."""

    def __init__(
        self,
        socket: zmq.Socket | None,
        frontends: FrontendSide,
        workers: WorkerSide,
        *,
        interval_s: float = 0.25,
        budget: float = 0.03,
        max_gap_s: float = 1.0,
    ) -> None:
        self.socket = socket
        self.frontends = frontends
        self.workers = workers
        self.interval_s = interval_s
        self.budget = budget
        self.max_gap_s = max_gap_s
        self.topics: set[bytes] = set()  # subscribed topics (any subscription means watched)
        self.busy_s = 0.0  # CPU time building and sending snapshots
        self.sent = 0
        self._next_at = 0.0
        self._last_at = 0.0  # when the last snapshot went out (0.0: none since watching began)
        self._held = False  # the budget is holding the next snapshot back past interval_s
        self._throttled = False  # ... and held the latest one back
        self._gap_s = 0.0  # between the latest snapshot and the one before
        self._watched_from = (0.0, 0.0)  # (scheduler busy, snapshot busy) when watching began
        self._started = time.monotonic()
        self._encoder = msgspec.msgpack.Encoder()
        self._events: deque[MonitorEvent] = deque(maxlen=EVENTS_SENT)
        self._seq = 0
        self._event_seq = 0
        self._last: tuple = ()  # the counters of the last snapshot, to find events

    @property
    def watched(self) -> bool:
        """True while some frontend subscribes."""
        return bool(self.topics)

    def on_events(self, events: dict) -> None:
        """Take the (un)subscriptions the XPUB reported in this poll's ``events``."""
        socket = self.socket
        if socket is None or socket not in events:
            return
        while socket.poll(0):
            frame = socket.recv()
            if frame[:1] == b"\x01":
                if not self.topics:
                    log.info("the web page's feed is watched")
                    self._next_at = self._last_at = 0.0
                    self._held = False
                    self._watched_from = (self.workers.busy_s, self.busy_s)
                self.topics.add(frame[1:])
            elif frame[:1] == b"\x00":
                self.topics.discard(frame[1:])

    def maybe_publish(self) -> None:
        """Publish a snapshot if someone watches and the last one is old enough, and only
        while the loop would wait anyway (steps in flight, or nothing to plan): a snapshot
        never delays a step."""
        now = time.monotonic()
        if self.socket is None or not self.watched or now < self._next_at:
            return
        if self.workers.can_step():
            return  # another step goes out first; a later turn of the loop publishes
        scheduler_s, snapshots_s = self._watched_from
        allowed = self.budget * (self.workers.busy_s - scheduler_s)
        if self.busy_s - snapshots_s > allowed:
            self._held = True  # due by the interval, held back by the budget
            if now - self._last_at < self.max_gap_s:
                return
        self.publish(throttled=self._held)
        self._held = False
        self._next_at = now + self.interval_s

    def publish(self, *, throttled: bool = False) -> None:
        """Build and send one snapshot now (dropped if the socket cannot take it);
        ``throttled``: the budget held it back past ``interval_s``."""
        if self.socket is None:
            return
        now = time.monotonic()
        self._gap_s = now - self._last_at if self._last_at else 0.0
        self._last_at, self._throttled = now, throttled
        started = time.thread_time()
        payload = self._encoder.encode(self.snapshot())
        try:
            self.socket.send(payload, zmq.DONTWAIT, copy=False)
            self.sent += 1
        except zmq.Again:
            pass  # the high-water mark: this frame is lost, the next one will do
        self.busy_s += time.thread_time() - started

    def snapshot(self) -> PoolSnapshot:
        """The pool, the queues, health and the latest events, as of now."""
        now = time.monotonic()
        health = self._health(now)
        self._find_events(health)
        engine = self.workers.engine
        pool, rows, running, waiting = None, [], 0, 0
        if engine is not None:
            s = engine.scheduler
            pool = pool_states(s.allocator, s.watermark_blocks)
            rows = request_rows(s.running, s.waiting, now)
            running, waiting = len(s.running), len(s.waiting)
        self._seq += 1
        return PoolSnapshot(
            seq=self._seq,
            time=time.time(),
            pool=pool,
            requests=rows,
            num_running=running,
            num_waiting=waiting,
            health=health,
            events=list(self._events),
            cadence=self.cadence(),
        )

    def cadence(self) -> Cadence:
        """How the latest snapshot was paced: the bounds, its gap, whether it was throttled."""
        return Cadence(
            interval_s=self.interval_s,
            max_gap_s=self.max_gap_s,
            budget=self.budget,
            gap_s=round(self._gap_s, 3),
            throttled=self._throttled,
        )

    def _health(self, now: float) -> Health:
        workers = self.workers
        stats = self.frontends.stats()
        ready = workers.worker.ready if workers.worker is not None else None
        known = ready or (workers.engine.ready_info if workers.engine is not None else None)
        state = "ready" if ready else ("lost" if workers.lost_since is not None else "none")
        audits = workers.audits
        audit = None
        if audits.at is not None:
            audit = AuditRecord(
                ok=audits.ok,
                seconds=audits.seconds,
                age_s=now - audits.at,
                error=audits.error,
                count=audits.count,
            )
        return Health(
            worker=state,
            reason="" if ready else workers.no_worker_reason,
            model_id=known.model_id if known else "",
            device=known.device if known else "",
            dtype=known.dtype if known else "",
            workers_lost_total=stats.workers_lost_total,
            frontends_lost_total=stats.frontends_lost_total,
            num_steps_total=stats.num_steps_total,
            steps_in_flight=stats.steps_in_flight,
            num_preemptions_total=stats.num_preemptions_total,
            audit=audit,
            uptime_s=now - self._started,
            monitor_s_total=self.busy_s,
            plan=dict(known.plan) if known else {},
        )

    def _find_events(self, health: Health) -> None:
        """Add an event for each counter or state that changed since the last snapshot."""
        audit = health.audit
        now = (
            health.worker,
            health.workers_lost_total,
            health.num_preemptions_total,
            health.frontends_lost_total,
            audit.count if audit is not None and not audit.ok else 0,
        )
        last = self._last or now
        self._last = now
        if now[1] > last[1]:
            self._event("worker", self.workers.no_worker_reason)
        if now[0] != last[0] and health.worker == "ready":
            self._event("worker", f"worker ready: {health.model_id} on {health.device}")
        elif now[0] != last[0] and health.worker == "none":
            self._event("worker", health.reason)
        if now[2] > last[2]:
            self._event("preemption", f"{now[2] - last[2]} preempted (recompute)")
        if now[3] > last[3]:
            self._event("frontend", f"{now[3] - last[3]} frontend(s) lost: requests aborted")
        if now[4] != last[4] and audit is not None:
            self._event("audit", f"audit failed: {audit.error}")

    def _event(self, kind: str, text: str) -> None:
        self._event_seq += 1
        event = MonitorEvent(seq=self._event_seq, time=time.time(), kind=kind, text=text)
        self._events.append(event)

    def close(self) -> None:
        """Close the socket, giving a last snapshot a moment to leave."""
        if self.socket is not None:
            self.socket.close(linger=200)
            self.socket = None
