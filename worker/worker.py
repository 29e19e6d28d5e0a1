"""``Worker``: owns the model and the KV cache, and runs one ``StepInput`` at a time.

The row contract (what each ``StepItem`` means for a slot's cache row) lives in ``worker.rows``;
this class only turns a checked step into one flattened forward and one sampling call.

Under tensor parallelism every rank builds a ``Worker`` over its ``Group``: each holds its shard
of the model and its heads of the pool, and runs every step; rank 0 (the leader) first shares
the step with the others (``worker.parallel.steps``) and alone samples, from the gathered logits.
"""

from __future__ import annotations

import logging
import time

import torch

from protocol.messages import (
    PROTOCOL_VERSION,
    RowSummary,
    Sample,
    StepInput,
    StepResult,
    WorkerReady,
)
from worker.attention import CpuKernelBackend, select_backend
from worker.compiled.background import BackgroundCompile, start_compile, wants_compile
from worker.config import WorkerConfig, resolve_max_model_len
from worker.cpu import kernels
from worker.cpu.machine import bound_onednn_cache, default_kv_budget, usable_cpus
from worker.cpu.threads import ThreadGovernor
from worker.grammar import grammar_masks
from worker.kv.cache import KVCache
from worker.linear.layouts import attach_q4, pack_for_cpu
from worker.model.llama import MLP, Attention, LlamaModel, ModelSpec, RMSNorm
from worker.parallel import steps as tp_steps
from worker.parallel.group import SOLO, Group
from worker.parallel.sharding import Shard
from worker.rows import RowTable, written_blocks
from worker.sampler import Sampler
from worker.shapes import padded_count

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
    ) -> None:
        """Load the model and size the cache. Compiled decode steps (``config.compile``; by
        default on CPU, off the generic path) are built here, or, with ``background_compile``,
        beside the steps: the worker runs eagerly until they are ready
        (``worker.compiled.background``)."""
        from models.files import resolve_model
        from worker.model.loader import load_checkpoint

        bound_onednn_cache()
        # By default the CPUs this process may use, shared between the host's ranks.
        self.num_threads = config.num_threads or max(1, usable_cpus() // group.local_size)
        torch.set_num_threads(self.num_threads)
        # One rank on CPU may drop to one thread beside a neighbour (ranks must stay alike).
        adapts = config.adapt_threads and config.resolved_device == "cpu" and group.size == 1
        self.threads = ThreadGovernor(self.num_threads if adapts else 1)
        self.config = config
        self.group = group
        self.device = config.resolved_device
        self.dtype = getattr(torch, config.resolved_dtype)
        self.files = resolve_model(config.model)
        self.q4_linears = 0  # linears that also hold 4-bit weights for small steps
        checkpoint = load_checkpoint(self.files, self.dtype, progress, self._shard_of)
        self.spec = ModelSpec.from_config(checkpoint.config)
        self.shard = Shard.of(self.spec, group.rank, group.size)
        self.eos_token_ids = checkpoint.eos_token_ids
        # The grammar engine builds in a thread of its own meanwhile; only the leader samples.
        self.grammar = grammar_masks(
            self.files, self.spec.vocab_size, self.eos_token_ids, eager=group.leader
        )
        self.max_model_len = resolve_max_model_len(config, checkpoint.config)
        self._load_model(checkpoint)
        self.kv_dtype = self._kv_dtype()
        self.cache = self._make_cache()
        self.row_table = RowTable(
            num_slots=config.num_slots,
            num_blocks=self.cache.num_blocks,
            block_size=config.block_size,
            max_model_len=self.max_model_len,
            seed=config.seed,
        )
        self._choose_kernels()
        self.compiled = None
        self.compile_job: BackgroundCompile | None = None
        if wants_compile(self):
            self.compiled, self.compile_job = start_compile(self, background_compile)
        self._in_step = False
        self._step_ended = time.monotonic()
        self.cache.populate(self.compile_job.wait if self.compile_job else None, self._busy)
        self.grammar.wait_built()  # before the worker announces itself: no step waits for it

    def _shard_of(self, model_config) -> Shard | None:
        """What this rank reads of every tensor (None: all of it); ValueError for a group size
        that does not split the model's heads."""
        if self.group.size == 1:
            return None
        return Shard.of(ModelSpec.from_config(model_config), self.group.rank, self.group.size)

    def _load_model(self, checkpoint) -> None:
        """The model on its device; on CPU, off the generic path, in its faster weight layouts.
        The 4-bit matrices are not sharded: a tensor-parallel rank keeps plain weights."""
        with torch.device("meta"):
            self.model = LlamaModel(self.spec, self.shard, self.group)
        self.model.load_weights(checkpoint.weights)
        self.model = self.model.to(self.device).eval()
        if self.config.generic_path or not pack_for_cpu(self.model):
            return
        # bfloat16; or float32 that ``auto`` chose (a CPU without native bfloat16), whose small
        # steps round their rows to bfloat16 for the 4-bit weights. An explicit float32 stays
        # exact.
        takes_q4 = self.dtype == torch.bfloat16 or self.config.dtype == "auto"
        if takes_q4 and self.config.q4_max_tokens and self.group.size == 1:
            self._attach_q4(checkpoint.config.model_type)

    def _choose_kernels(self) -> None:
        """The attention backend and the sampler's argmax, chosen once. Asked now, so that the
        first build of ``worker.cpu.kernels`` happens before the worker announces itself, not in a
        step."""
        generic = self.config.generic_path
        own_kernels = self.device == "cpu" and not generic and kernels.available()
        # ``auto``'s float32 (its linears already take 8-bit activations; an explicit float32
        # stays exact): eager norms and SwiGLU in the AVX2 kernels.
        auto_float32 = self.config.dtype == "auto" and self.dtype == torch.float32
        own_f32 = auto_float32 and self.device == "cpu" and not generic and kernels.loaded()
        self.sampler = Sampler(self.eos_token_ids, own_argmax=own_kernels)
        for module in self.model.modules():
            if isinstance(module, (RMSNorm, MLP, Attention)):
                module.kernel = own_kernels
            if isinstance(module, (RMSNorm, MLP)):
                module.kernel_f32 = own_f32
        self.attention = select_backend(
            n_heads=self.shard.local_heads,
            n_kv_heads=self.shard.local_kv_heads,
            head_dim=self.spec.head_dim,
            block_size=self.config.block_size,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            device=self.device,
            generic=generic,
        )

    def _attach_q4(self, model_type: str) -> None:
        """Small steps on the GGUF's own 4-bit matrices, where it has them (see ``Linear``)."""
        from worker.model.loader import load_q4

        if self.files.gguf_file is None:
            return
        tensors = load_q4(self.files, model_type, self.spec.n_heads, self.spec.n_kv_heads)
        self.q4_linears = attach_q4(
            self.model, tensors, self.config.q4_max_tokens, self.config.w4a8
        )

    @property
    def decode_path(self) -> str:
        """What decode steps run on: "eager", "compiling" (eagerly meanwhile), "compiled" or
        "failed" (eagerly, the graphs could not be built)."""
        if self.compiled is not None:
            return "compiled"
        job = self.compile_job
        if job is None:
            return "eager"
        return "compiled" if job.state == "ready" else job.state  # the next step adopts it

    def _kv_dtype(self) -> torch.dtype:
        """The pool's dtype (``WorkerConfig.kv_cache_dtype``): the model's, or float16 under a
        float32 model whose decodes run in the AVX2 kernel, which widens it as it reads; ValueError
        for any other."""
        wanted = self.config.kv_cache_dtype
        half_ok = (
            self.dtype == torch.float32
            and not self.config.generic_path
            and CpuKernelBackend.supports(
                self.dtype,
                self.device,
                self.spec.head_dim,
                self.shard.local_heads,
                self.shard.local_kv_heads,
            )
        )
        if wanted == "auto":
            auto_float32 = self.config.dtype == "auto"
            return torch.float16 if half_ok and auto_float32 else self.dtype
        chosen = getattr(torch, wanted)
        if chosen != self.dtype and not (chosen == torch.float16 and half_ok):
            raise ValueError(
                f"kv_cache_dtype {wanted} needs a {wanted} model, or float16 a float32 one on a "
                f"CPU with AVX2 and F16C (this worker: {self.dtype} on {self.device})"
            )
        return chosen

    def _make_cache(self) -> KVCache:
        spec, config = self.spec, self.config
        geometry = dict(
            num_layers=spec.num_layers,
            block_size=config.block_size,
            n_kv_heads=self.shard.local_kv_heads,
            head_dim=spec.head_dim,
            dtype=self.kv_dtype,
        )
        num_blocks = config.num_blocks
        if num_blocks is None:
            # A host's CPU ranks share its RAM (each GPU rank has its own device); an explicit
            # --kv-cache-memory is each rank's own.
            ranks_here = self.group.local_size if self.device == "cpu" else 1
            budget = config.kv_cache_memory or default_kv_budget(self.device) // ranks_here
            per_block = KVCache.bytes_per_block(**geometry)
            num_blocks = KVCache.blocks_for_budget(
                budget, per_block, self.max_model_len, config.block_size
            )
        num_blocks = self.group.min_int(num_blocks)  # one pool: the same block count everywhere
        return KVCache(num_blocks=num_blocks, device=self.device, **geometry)

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
            device=self.device,
            dtype=self.config.resolved_dtype,
            tensor_parallel_size=self.group.size,
            plan={
                "device": self.device,
                "dtype": self.config.resolved_dtype,
                "kv_dtype": str(self.kv_dtype).removeprefix("torch."),
                "attention": self.attention.name,
                "decode": self.decode_path,
                "threads": str(self.num_threads),
            },
        )

    def execute(self, step: StepInput) -> StepResult:
        """Run one step: release rows, compute every item, sample where asked."""
        self._in_step = True
        try:
            return self.execute_with_logits(step)[0]
        finally:
            self._in_step = False
            self._step_ended = time.monotonic()

    def _busy(self) -> bool:
        """Whether a step runs, or ran within ``IDLE_AFTER_S``: the KV pool's pages are backed
        only outside that (``worker.kv.host_pool``), so that backing them takes no CPU from
        steps."""
        return self._in_step or time.monotonic() - self._step_ended < IDLE_AFTER_S

    def execute_with_logits(self, step: StepInput) -> tuple[StepResult, torch.Tensor]:
        """``execute``, also returning the float32 logits (S, vocab) of the sampled items."""
        began = time.perf_counter()
        if self.group.leader and self.group.size > 1:
            step = tp_steps.lead(self.group, step, self.row_table)
        self.row_table.check(step, self.spec.vocab_size)
        self.row_table.release(step.released_slots)
        applied = [self.row_table.apply(item) for item in step.items]
        bs = self.config.block_size
        rows = [row for row, _ in applied]
        self.cache.zero_blocks([b for item in step.items for b in written_blocks(item, bs)])
        sampled = [(item, row) for item, row in zip(step.items, rows, strict=True) if item.sample]
        if not self.group.leader:  # a rank other than the leader only computes its share
            sampled = []
        masks = self.grammar.start([row for _, row in sampled])  # filled during the forward
        logits = self._forward(step, applied)
        draws = self.sampler.sample(logits, [row for _, row in sampled], masks) if sampled else []
        for (_, row), draw in zip(sampled, draws, strict=True):
            row.last_sampled = draw.token_id  # stays here: the next step may feed it back
        samples = [
            Sample(
                request_id=item.request_id,
                token_id=draw.token_id,
                logprob=draw.logprob,
                top_logprobs=draw.top_logprobs,
            )
            for (item, _), draw in zip(sampled, draws, strict=True)
        ]
        result = StepResult(
            step_id=step.step_id,
            samples=samples,
            rows=self.rows() if step.audit else None,
            forward_s=time.perf_counter() - began,
            grammar_rows=len(masks.index) if masks else 0,
            grammar_fill_s=masks.fill_s if masks else 0.0,
            grammar_apply_s=masks.apply_s if masks else 0.0,
            decode_path=self.decode_path,
            num_threads=torch.get_num_threads(),
        )
        self.threads.after_step(result.forward_s)  # the next step may run on another count
        return result, logits

    def _forward(self, step: StepInput, applied) -> torch.Tensor | None:
        """One flattened forward over every item -> logits (S, vocab) of the sampled items (on
        the leader; None on the other ranks). ``applied`` is each item's (row, tokens) from
        ``RowTable.apply``."""
        if not step.items:
            return torch.zeros(0, self.spec.vocab_size)
        ids, positions, last, spans = [], [], [], []
        for item, (row, tokens) in zip(step.items, applied, strict=True):
            ids.extend(tokens)
            positions.extend(range(item.start, item.start + len(tokens)))
            if item.sample:
                last.append(len(ids) - 1)
            spans.append((row.block_table, item.start, len(tokens)))
        with torch.inference_mode():  # everything, the metadata too: compiled graphs guard on it
            meta = self.attention.metadata(spans, trash_block=self.cache.trash_block)
            # Padding tokens (id 0 at position 0) fill the step up to its bucketed size; so do
            # copies of the first sampled row for the lm head (see worker.shapes).
            padding = meta.num_tokens - len(ids)
            ids.extend([0] * padding)
            positions.extend([0] * padding)
            sampled = last + last[:1] * (padded_count(len(last)) - len(last))
            ids_t = torch.tensor(ids, device=self.device)
            pos_t = torch.tensor(positions, device=self.device)
            compiled = self._compiled()
            if compiled is not None and compiled.accepts(meta):
                hidden = compiled(ids_t, pos_t, meta)  # (T, hidden)
            else:
                hidden = self.model(ids_t, pos_t, meta, self.cache, self.attention)
            if not last:  # every rank knows it: the step is the same everywhere
                return torch.zeros(0, self.spec.vocab_size) if self.group.leader else None
            scores = self.model.logits(hidden[sampled])  # (S', vocab range) of this rank
            logits = self.group.gather_vocab(scores, self.spec.vocab_size)
            return None if logits is None else logits[: len(last)].cpu()  # (S, vocab)

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
        """Tell the other ranks to stop (the leader), and leave the group."""
        if self.group.leader and self.group.size > 1:
            tp_steps.lead_shutdown(self.group)
        self.group.close()

    def rows(self) -> list[RowSummary]:
        """Every slot's row as it stands now."""
        return self.row_table.summaries()
