"""WorkerView: what the frontends are told of the worker (``SchedulerInfo``, the gauges), as
``scheduler.worker_side.WorkerSide`` knows it; a mixin of that class."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec

from protocol.messages import PROTOCOL_VERSION, EngineStats, SchedulerInfo

if TYPE_CHECKING:
    from scheduler.engine import Engine


class WorkerView:
    """WorkerSide's answers about its worker."""

    @property
    def engine(self) -> Engine | None:
        """The process's engine once a worker has sized it, None before (the monitor reads it)."""
        return self._engine if self._engine.fitted else None

    @property
    def steps_in_flight(self) -> int:
        """Steps sent to the current worker whose results have not come back (the engine keeps
        that ledger, and forgets a lost worker's steps with it)."""
        return self._engine.num_in_flight if self.worker is not None else 0

    def accepts_requests(self) -> bool:
        """True while requests can be queued: a worker is ready, or one was lost lately and
        may come back."""
        return self._engine.fitted and (self.worker is not None or self.lost_since is not None)

    def info(self) -> SchedulerInfo:
        """The SchedulerInfo every frontend gets: the worker's geometry and plan, or why there is
        none."""
        ready = self.worker.ready if self.worker else None
        return SchedulerInfo(
            protocol_version=PROTOCOL_VERSION,
            worker_ready=ready is not None,
            model_id=ready.model_id if ready else "",
            max_model_len=ready.max_model_len if ready else 0,
            num_blocks=ready.num_blocks if ready else 0,
            block_size=ready.block_size if ready else 0,
            reason="" if ready else self.no_worker_reason,
            worker_plan=dict(ready.plan) if ready else {},
        )

    def stats(self) -> EngineStats:
        """The engine's stats with this side's own gauges and counters."""
        return msgspec.structs.replace(
            self._engine.stats(),
            worker_ready=self.worker is not None,
            steps_in_flight=self.steps_in_flight,
            worker_resident_bytes=self.worker.resident_bytes if self.worker else 0,
            worker_decode_path=self.worker.decode_path if self.worker else "",
            worker_threads=self.worker.num_threads if self.worker else 0,
            worker_thread_switches_total=self.thread_switches,
            scheduler_busy_s_total=self.busy_s,
            scheduler_cpu_s_total=time.process_time(),
            bad_messages_total=self.bad_messages,
            workers_lost_total=self.workers_lost,
            worker_death_to_token_s_sum=self.stalls.total_s,
            worker_death_to_token_s_count=self.stalls.count,
            worker_death_to_token_s_last_max=self.stalls.last_max_s,
        )
