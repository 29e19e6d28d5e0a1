"""A fault injector for tests: the worker SIGKILLs itself in the middle of a step.

``NANOSERVE_FAULT_KILL_AT=<position>:<layer>``, read once when the worker process starts: in
the first step with an item whose tokens cover a row's position ``<position>``, the worker logs
the step's items and SIGKILLs itself right after decoder layer ``<layer>`` (counted from 0) has
run, so its K/V is written for layers ``0..<layer>`` and not for the layers above. A kill sent
from outside lands wherever the worker happens to be; this one lands inside a chosen step, at a
chosen layer, every time. A position, not a step's ordinal, picks the step: which requests a
step carries depends on when they arrived over HTTP, the positions a prompt's chunks cover do
not (``tests/faults/test_shared_pool.py`` kills a prefill chunk that ends inside a block).

It arms only in the first worker on a shared K/V pool (the pool's generation 1): the worker the
supervisor restarts inherits the variable, and would otherwise die again at the same position.
Unset, it costs nothing: no hook exists. Armed, the worker's ``launch`` and the model's eager
layer loop are wrapped, and only the marked step's layer gets a kill (an eager forward only: a
compiled decode step writes every layer's K/V after its graph, and only decode steps run
compiled).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

from protocol.messages import StepInput

VARIABLE = "NANOSERVE_FAULT_KILL_AT"

log = logging.getLogger("nanoserve.worker")


class KillInStep:
    """SIGKILL this process after layer ``layer`` in the first step that writes ``position``."""

    def __init__(self, position: int, layer: int) -> None:
        self.position, self.layer = position, layer
        self.step: StepInput | None = None  # the step to die in, while it runs

    @classmethod
    def parse(cls, value: str) -> KillInStep:
        """``"<position>:<layer>"``; ValueError, naming the variable, for anything else."""
        try:
            position, layer = (int(part) for part in value.split(":"))
        except ValueError:
            raise ValueError(f"{VARIABLE}={value!r}: expected <position>:<layer>") from None
        if position < 0 or layer < 0:
            raise ValueError(f"{VARIABLE}={value!r}: position and layer must be >= 0")
        return cls(position, layer)

    def arm(self, worker) -> None:
        """Wrap ``worker.launch`` (the step that writes the position is marked) and the model's
        eager layer loop (in the marked step, layer ``layer``'s attention, which writes its
        K/V, is followed by the kill)."""
        if self.layer >= worker.spec.num_layers:
            layers = worker.spec.num_layers
            raise ValueError(f"{VARIABLE}: layer {self.layer}, but the model has {layers}")
        worker.launch = self._launch(worker.launch)
        worker.model.run_layers = self._run_layers(worker.model.run_layers)
        log.warning(
            "fault injector armed: SIGKILL after layer %d's K/V write in the step that writes "
            "position %d",
            self.layer,
            self.position,
        )

    def _launch(self, launch: Callable) -> Callable:
        def marked(step: StepInput):
            if any(i.start <= self.position < i.start + len(i.token_ids) for i in step.items):
                self.step = step
            try:
                return launch(step)
            finally:
                self.step = None

        return marked

    def _run_layers(self, run_layers: Callable) -> Callable:
        def run(x, cos, sin, attends, ops):
            if self.step is not None:  # the marked step: its layer's attend kills after it
                attends = list(attends)
                attends[self.layer] = self._then_kill(attends[self.layer])
            return run_layers(x, cos, sin, attends, ops)

        return run

    def _then_kill(self, attend: Callable) -> Callable:
        def attend_then_kill(*args, **kwargs):
            attend(*args, **kwargs)  # writes the layer's K/V into the pool, then attends
            self._kill()

        return attend_then_kill

    def _kill(self) -> None:
        step = self.step
        assert step is not None
        items = " ".join(
            f"{item.slot}:{item.start}+{len(item.token_ids)}{'s' if item.sample else ''}"
            for item in step.items
        )
        log.warning(
            "fault injector: SIGKILL in step %d after layer %d's K/V write; items "
            "(slot:start+tokens, s: sampled): %s",
            step.step_id,
            self.layer,
            items,
        )
        for handler in (*logging.getLogger().handlers, *log.handlers):
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def arm_from_environment(worker) -> KillInStep | None:
    """Arm the injector that ``NANOSERVE_FAULT_KILL_AT`` asks for, if any, in the first worker
    on a shared pool; None when unset or not armed (a restarted or private-pool worker)."""
    value = os.environ.get(VARIABLE)
    if not value:
        return None
    injector = KillInStep.parse(value)
    attachment = worker.cache.attachment
    if not attachment.shared or attachment.generation != 1:
        log.info("fault injector not armed: this worker is not the first on a shared KV pool")
        return None
    injector.arm(worker)
    return injector
