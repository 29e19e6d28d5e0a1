"""``Worker``: owns the model and the KV cache, and runs ``StepInput``s in order.

The row contract (what each ``StepItem`` means for a slot's cache row) lives in ``worker.rows``;
this class only turns a checked step into one packed copy of its inputs
(``worker.step.inputs``), one flattened forward (a captured decode graph where one fits:
``worker.step.graphs``) and one batched sampling call on the device (``worker.sampling.device``).
``launch`` queues all of that without waiting; ``finish`` waits for the sampled ids, the one
wait a step has (``worker.step.in_flight``), so the host prepares the next step meanwhile.

Under tensor parallelism every rank builds a ``Worker`` over its ``Group``: each holds its shard
of the model and its heads of the pool, and runs every step; rank 0 (the leader) first shares
the step with the others (``worker.parallel.steps``) and alone samples, from the gathered logits.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from protocol.messages import PROTOCOL_VERSION, RowSummary, StepInput, StepResult, WorkerReady
from worker.attention import make_backend
from worker.compiled.background import BackgroundCompile, start_compile
from worker.config import WorkerConfig
from worker.cpu.machine import bound_onednn_cache
from worker.cpu.threads import ThreadGovernor
from worker.grammar import grammar_masks
from worker.kv.written import filled_blocks, partial_ranges
from worker.loading import load, make_cache
from worker.model.ops import ModelOps
from worker.parallel import steps as tp_steps
from worker.parallel.group import SOLO, Group
from worker.plan import Plan
from worker.rows import RowTable, written_blocks
from worker.step.in_flight import Launched
from worker.step.runner import StepRunner

log = logging.getLogger("nanoserve.worker")

# The worker counts as idle this long after its last step: at concurrency 1 the next request's
# step follows the last one's within tens of ms (its HTTP round trip).
IDLE_AFTER_S = 0.2


class Worker:
    """Loads the model and sizes the cache from a ``WorkerConfig``; then ``execute`` steps."""

    def __init__(
        self,
        config: WorkerConfig,
        progress: bool = True,
        group: Group = SOLO,
        background_compile: bool = False,
        plan: Plan | None = None,
        holder: str | None = None,
    ) -> None:
        """Load the model and size the cache, running as the worker's plan says (``plan``, or
        the one resolved for this machine: ``worker.plan``). Compiled decode steps (the plan's
        ``compile``) are built here, or, with ``background_compile``, beside the steps: the
        worker runs eagerly until they are ready (``worker.compiled.background``). ``holder``:
        the pool holder's address, asked for the pool with ``--shared-kv-pool``."""
        bound_onednn_cache()
        self.config, self.group = config, group
        loaded = load(config, group, plan, progress)
        self.plan = loaded.plan
        self.files, self.spec, self.shard = loaded.files, loaded.spec, loaded.shard
        self.model, self.q4_linears = loaded.model, loaded.q4_linears
        self.eos_token_ids, self.max_model_len = loaded.eos_token_ids, loaded.max_model_len
        # The grammar engine builds in a thread of its own meanwhile; only the leader samples.
        self.grammar = grammar_masks(
            self.files, self.spec.vocab_size, self.eos_token_ids, eager=group.leader
        )
        self.num_threads = self.plan.threads
        torch.set_num_threads(self.num_threads)
        self.threads = ThreadGovernor(self.num_threads if self.plan.adapt_threads else 1)
        self.ops = ModelOps.for_plan(self.plan)
        self.cache = make_cache(config, loaded, group, holder)
        self.row_table = RowTable(
            num_slots=config.num_slots,
            num_blocks=self.cache.num_blocks,
            block_size=config.block_size,
            max_model_len=self.max_model_len,
            seed=config.seed,
            attached=self.cache.attachment.reused,
        )
        self.attention = make_backend(
            self.plan,
            n_heads=self.shard.local_heads,
            n_kv_heads=self.shard.local_kv_heads,
            head_dim=self.spec.head_dim,
            block_size=config.block_size,
        )
        self._in_flight: deque[Launched] = deque()
        self.compiled = None
        self.compile_job: BackgroundCompile | None = None
        if self.plan.compile == "inductor":
            self.compiled, self.compile_job = start_compile(self, background_compile)
        self.runner = StepRunner(
            model=self.model,
            cache=self.cache,
            attention=self.attention,
            ops=self.ops,
            plan=self.plan,
            group=group,
            vocab=self.spec.vocab_size,
            eos_token_ids=self.eos_token_ids,
            num_slots=config.num_slots,
            max_model_len=self.max_model_len,
            compiled=self._compiled,
        )
        self.sampler, self.graphs = self.runner.sampler, self.runner.graphs
        self._in_step = False
        self._step_ended = time.monotonic()
        self.cache.populate(self.compile_job.wait if self.compile_job else None, self._busy)
        self.grammar.wait_built()  # before the worker announces itself: no step waits for it

    @property
    def decode_path(self) -> str:
        """What decode steps run on: "eager", "graphs" (``worker.step.graphs``), "compiling"
        (eagerly meanwhile), "compiled" or "failed" (eagerly, the graphs could not be built)."""
        if self.graphs is not None:
            return "graphs"
        if self.compiled is not None:
            return "compiled"
        job = self.compile_job
        if job is None:
            return "eager"
        return "compiled" if job.state == "ready" else job.state  # the next step adopts it

    def ready(self) -> WorkerReady:
        """The announcement of this worker's cache geometry."""
        return WorkerReady(
            protocol_version=PROTOCOL_VERSION,
            model_id=self.files.model_id,
            num_blocks=self.cache.num_blocks,
            block_size=self.config.block_size,
            num_slots=self.config.num_slots,
            max_model_len=self.max_model_len,
            eos_token_ids=list(self.eos_token_ids),
            vocab_size=self.spec.vocab_size,
            device=self.plan.device,
            dtype=self.plan.dtype,
            tensor_parallel_size=self.group.size,
            plan=self.plan.summary(),
            pool_id=self.cache.attachment.pool_id,
            pool_generation=self.cache.attachment.generation,
            pool_fallback=self.cache.attachment.fallback,
            pool_ranks=[(pool.pool_id, pool.generation) for pool in self.cache.attachment.ranks],
        )

    def execute(self, step: StepInput) -> StepResult:
        """Run one step: release rows, compute every item, sample where asked."""
        return self.finish(self.launch(step))

    def _busy(self) -> bool:
        """Whether a step runs, or ran within ``IDLE_AFTER_S``: the pool's pages are backed only
        outside that (``worker.kv.host_pool``), so backing them takes no CPU from steps."""
        return self._in_step or time.monotonic() - self._step_ended < IDLE_AFTER_S

    def execute_with_logits(self, step: StepInput) -> tuple[StepResult, torch.Tensor | None]:
        """``execute``, also returning the float32 logits (S, vocab) of the sampled items (on
        the leader; None on the other ranks)."""
        launched = self.launch(step)
        result = self.finish(launched)
        if launched.logits is None:
            return result, torch.zeros(0, self.spec.vocab_size) if self.group.leader else None
        return result, launched.logits.cpu()

    def launch(self, step: StepInput) -> Launched:
        """Check and apply a step to the rows, and queue its forward and sampling on the device
        without waiting for them (``worker.step.in_flight``): ``finish`` each launched step, in
        order. ValueError, changing nothing, for a step that breaks the row protocol."""
        self._in_step = True
        began = time.perf_counter()
        try:
            if self.group.leader and self.group.size > 1:
                self.settle()  # the leader names every pending token to the other ranks
                step = tp_steps.lead(self.group, step, self.row_table)
            self.row_table.check(step, self.spec.vocab_size)
            # Only the leader answers the scheduler: it sums every rank's shard of a block.
            leader, bs = self.group.leader, self.config.block_size
            asked = (step.verify_blocks, step.verify_ranges) if leader else ([], [])
            verified, verified_ranges = self.cache.asked_sums(*asked)
            self.row_table.release(step.released_slots)
            self.row_table.rewind(step.rewinds)
            applied = [self.row_table.apply(item) for item in step.items]
            self.cache.zero_blocks([b for item in step.items for b in written_blocks(item, bs)])
            for item in step.items:
                if item.attached and item.start % bs:  # its last block's head holds K/V
                    self.cache.zero_tail(item.new_blocks[item.start // bs], item.start % bs)
            pairs = zip(step.items, applied, strict=True)
            sampled = [(item, row) for item, (row, _) in pairs if item.sample]
            if not self.group.leader:  # a rank other than the leader only computes its share
                sampled = []
            for item, row in sampled:
                row.sampled = not item.num_draft  # no pending token follows a draft item
            # Every sampled position, as the runner samples them: a draft item's k + 1.
            backs = [back for item, _ in sampled for back in range(item.num_draft, -1, -1)]
            rows = [row for item, row in sampled for _ in range(item.num_draft + 1)]
            grammar = any(row.params.grammar is not None for _, row in sampled)

            def start_masks():
                """The constrained rows' masks, filled in a thread (None: no such row)."""
                if grammar:
                    self.settle()  # a matcher follows the tokens its row was fed, on the host
                return self.grammar.start(rows, backs)

            # Masks are filled while the forward runs: started before it when the tokens they
            # need are back already (always, on the CPU), else once it is queued, so that
            # waiting for them does not keep the device waiting too.
            early = not grammar or all(launched.done() for launched in self._in_flight)
            audit = self.rows() if step.audit else None
            with torch.inference_mode():  # everything: compiled graphs guard on it
                launched = self.runner.queue(step, applied, sampled, start_masks, early, audit)
            launched.launch_s = time.perf_counter() - began
            launched.verified, launched.verified_ranges = verified, verified_ranges
            if self.cache.attachment.shared and leader:  # sum what it writes
                launched.filled = filled_blocks(step, applied, bs)
                launched.partial = partial_ranges(step, applied, bs)
                launched.sums = self.cache.queue_sums(launched.filled, launched.partial)
            self._in_flight.append(launched)
            return launched
        finally:
            self._in_step = False

    def finish(self, launched: Launched) -> StepResult:
        """The result of the oldest launched step, once its sampled ids are back."""
        if not self._in_flight or self._in_flight[0] is not launched:
            raise RuntimeError("launched steps finish in the order they were launched")
        self._in_step = True
        began = time.perf_counter()
        try:
            samples = launched.samples()
        finally:
            self._in_flight.popleft()
            self._in_step = False
            self._step_ended = time.monotonic()
        masks = launched.masks
        filled, partial = self.cache.written_sums(launched.filled, launched.partial, launched.sums)
        result = StepResult(
            step_id=launched.step.step_id,
            samples=samples,
            rows=launched.rows,
            forward_s=launched.launch_s + time.perf_counter() - began,
            grammar_rows=len(masks.index) if masks else 0,
            grammar_fill_s=masks.fill_s if masks else 0.0,
            grammar_apply_s=masks.apply_s if masks else 0.0,
            grammar_compiles=masks.compiles if masks else 0,
            decode_path=self.decode_path,
            num_threads=torch.get_num_threads(),
            block_sums=launched.verified + filled,
            range_sums=launched.verified_ranges + partial,
        )
        self.threads.after_step(result.forward_s)  # the next step may run on another count
        return result

    def settle(self) -> None:
        """Wait for every launched step's sampled ids and write them into the rows (their
        results still go out in order, through ``finish``)."""
        for launched in self._in_flight:
            launched.resolve()

    @property
    def in_flight(self) -> int:
        """Steps launched and not finished."""
        return len(self._in_flight)

    def _compiled(self):
        """The compiled decode step, adopting the background job's once it is ready (here, in
        the thread that runs steps)."""
        job = self.compile_job
        if self.compiled is None and job is not None and job.state == "ready":
            self.compiled = job.result
            log.info("decode steps run compiled from now on (%s in %.1f s)", job.how, job.seconds)
        return self.compiled

    def reset(self) -> None:
        """Empty every row (a new scheduler knows nothing of them, or a step was refused); the
        leader has every rank do the same."""
        if self.group.leader and self.group.size > 1:
            tp_steps.lead_reset(self.group)
        self.row_table.release(list(range(len(self.row_table.rows))))

    def idle(self) -> None:
        """Called while no step comes: the leader keeps the other ranks' collectives alive."""
        if self.group.leader and self.group.size > 1:
            self.group.send_message(None)

    def close(self) -> None:
        """Stop backing the pool, tell the other ranks to stop (the leader), leave the group."""
        self.cache.close()
        if self.group.leader and self.group.size > 1:
            tp_steps.lead_shutdown(self.group)
        self.group.close()

    def rows(self) -> list[RowSummary]:
        """Every slot's row as it stands now."""
        return self.row_table.summaries()
