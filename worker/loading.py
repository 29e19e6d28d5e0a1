"""Everything a ``Worker`` is built from, loaded once at start: the model on its device with
its plan applied (``load``), and its KV pool (``make_cache``).

The plan is resolved between loading the checkpoint and giving each linear its method: it needs
the shard's heads and what the file holds in 4 bits (``worker.linear.build.q4_facts``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from models.files import ModelFiles, resolve_model
from protocol.blocks import blocks_for
from protocol.kv_pool import PoolGeometry
from worker.config import WorkerConfig, resolve_max_model_len
from worker.kv.cache import KVCache, default_budget
from worker.kv.shared import (
    ATTACH_TIMEOUT_S,
    DEVICE_ATTACH_TIMEOUT_S,
    RANK_WAIT_S,
    Attachment,
    PeerPools,
    agree,
    attach,
    private,
)
from worker.linear.build import apply_plan, q4_facts
from worker.model.llama import LlamaModel, ModelSpec
from worker.model.loader import load_checkpoint, load_q4
from worker.parallel.group import Group
from worker.parallel.sharding import Shard
from worker.plan import Plan, resolve, resolve_device, resolve_dtype, resolve_threads, wants_4bit

log = logging.getLogger("nanoserve.worker")


@dataclass(frozen=True)
class Loaded:
    """A loaded model and the plan it runs."""

    files: ModelFiles
    spec: ModelSpec
    shard: Shard
    model: LlamaModel
    plan: Plan
    eos_token_ids: list[int]
    max_model_len: int
    q4_linears: int  # linears that run on the file's 4-bit matrices


def load(config: WorkerConfig, group: Group, plan: Plan | None, progress: bool) -> Loaded:
    """Load ``config``'s model for this rank of ``group``; the plan is ``plan`` if given (tests
    change one to see what it changes), else resolved for this machine."""
    files = resolve_model(config.model)
    if plan is not None:
        plan.load_kernels()
    device = plan.device if plan else resolve_device(config)
    dtype = plan.dtype if plan else resolve_dtype(config, device)
    # Loading is faster on every thread it may use (the plan's count, known before the plan).
    torch.set_num_threads(plan.threads if plan else resolve_threads(config, group.local_size))

    def shard_of(model_config) -> Shard | None:
        """What this rank reads of every tensor (None: all of it); ValueError for a group size
        that does not split the model's heads."""
        if group.size == 1:
            return None
        return Shard.of(ModelSpec.from_config(model_config), group.rank, group.size)

    checkpoint = load_checkpoint(files, getattr(torch, dtype), progress, shard_of)
    spec = ModelSpec.from_config(checkpoint.config)
    shard = Shard.of(spec, group.rank, group.size)
    with torch.device("meta"):
        model = LlamaModel(spec, shard, group)
    model.load_weights(checkpoint.weights)
    model = model.to(device).eval()
    q4 = {}
    if files.gguf_file is not None and wants_4bit(config, device, dtype, group.size):
        model_type = checkpoint.config.model_type
        q4 = load_q4(files, model_type, spec.n_heads, spec.n_kv_heads)
    plan = plan or resolve(
        config,
        device=device,
        dtype=dtype,
        head_dim=spec.head_dim,
        n_heads=shard.local_heads,
        n_kv_heads=shard.local_kv_heads,
        q4=q4_facts(model, q4),
        group_size=group.size,
        local_size=group.local_size,
    )
    q4_linears = apply_plan(model, plan, q4)
    return Loaded(
        files=files,
        spec=spec,
        shard=shard,
        model=model,
        plan=plan,
        eos_token_ids=checkpoint.eos_token_ids,
        max_model_len=resolve_max_model_len(config, checkpoint.config),
        q4_linears=q4_linears,
    )


def make_cache(
    config: WorkerConfig, loaded: Loaded, group: Group, holder: str | None = None
) -> KVCache:
    """The K/V pool: ``config.num_blocks``, or as many blocks as the budget holds
    (``--kv-cache-memory``, else the plan's pool's default), the same count on every rank.
    With ``--shared-kv-pool``, the pool holder's at ``holder`` (any size when the count came
    from a budget), else a private one, and one log line says why."""
    spec, plan = loaded.spec, loaded.plan
    geometry = dict(
        num_layers=spec.num_layers,
        block_size=config.block_size,
        n_kv_heads=loaded.shard.local_kv_heads,
        head_dim=spec.head_dim,
        dtype=plan.torch_kv_dtype,
    )
    num_blocks, short = config.num_blocks, None
    if num_blocks is None:
        # A host's ranks share its RAM (each GPU rank has its own device); an explicit
        # --kv-cache-memory is each rank's own.
        ranks_here = group.local_size if plan.kv_pool == "host" else 1
        budget = config.kv_cache_memory or default_budget(plan.kv_pool) // ranks_here
        per_block = KVCache.bytes_per_block(**geometry)
        try:
            num_blocks = KVCache.blocks_for_budget(
                budget, per_block, loaded.max_model_len, config.block_size
            )
        except ValueError as exc:
            if not (config.shared_kv_pool and plan.kv_pool == "device"):
                raise
            # A worker that restarts beside the holder's device pool finds the GPU's memory
            # taken by the very pool it is about to open: it asks for any size (the holder's
            # pool is adopted), and the budget's error stands only if it gets none.
            short = exc
            num_blocks = blocks_for(loaded.max_model_len, config.block_size)
    num_blocks = group.min_int(num_blocks)  # one pool: the same block count everywhere
    attachment = None
    if config.shared_kv_pool:
        attachment = _attach(
            config.standby_workers > 0,
            holder,
            plan.kv_pool,
            plan.device,
            group,
            num_blocks,
            config.num_blocks is None,
            **geometry,
        )
        if group.size > 1:  # the group's pools are shared only if every rank's is
            attachment = agree(group, attachment)
        if attachment.geometry is not None:
            num_blocks = attachment.geometry.num_blocks
            _log_shared(attachment, group)
        elif group.leader:  # a group's fallback is one line: the leader's
            log.warning(
                "KV pool: private, not shared (%s): %s", attachment.fallback, attachment.reason
            )
    if short is not None and (attachment is None or attachment.geometry is None):
        raise short
    cache = KVCache(
        num_blocks=num_blocks,
        device=plan.device,
        pool=plan.kv_pool,
        attachment=attachment,
        **geometry,
    )
    if attachment is not None and attachment.ranks and group.leader:
        cache.peers = PeerPools(attachment.ranks, group.rank)  # its sums cover every shard
    return cache


def _log_shared(attachment: Attachment, group: Group) -> None:
    """One line, the leader's: the pool (of a group: every rank's) it mapped."""
    if not group.leader or attachment.geometry is None:
        return
    pools = ", ".join(
        f"rank {rank} {pool.pool_id} generation {pool.generation}"
        for rank, pool in enumerate(attachment.ranks)
    )
    log.info(
        "KV pool: shared pool %s, generation %d (%s)%s",
        attachment.pool_id,
        attachment.generation,
        attachment.geometry.describe(),
        f"; the group's pools: {pools}" if pools else "",
    )


def _attach(
    standby: bool,
    holder: str | None,
    pool: str,
    device: str,
    group: Group,
    num_blocks: int,
    any_size: bool,
    *,
    num_layers: int,
    block_size: int,
    n_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> Attachment:
    """The pool holder's pool for this geometry, or why the pool stays private: a host pool
    as a file, a device pool (CUDA) as the holder's device memory."""
    where = "cpu"
    if pool != "host":
        if group.size > 1:  # the leader's sums read every rank's pool, from the host
            return private("device", "a tensor-parallel group's device pools are not shared")
        index = torch.device(device).index
        where = f"cuda:{torch.cuda.current_device() if index is None else index}"
    elif group.local_size < group.size:  # the leader sums every rank's pool, from this host
        return private("tensor_parallel_hosts", "ranks on several hosts keep private pools")
    if holder is None:
        return private("no_holder", "no pool holder address")
    geometry = PoolGeometry(
        num_layers=num_layers,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=str(dtype).removeprefix("torch."),
        num_blocks=num_blocks,
        rank=group.rank,
        world_size=group.size,
        device=where,
    )
    # A restarted group's rank may ask before the lost group's rank has stopped mapping it.
    wait_s = RANK_WAIT_S if group.size > 1 else 0.0
    # A holder's first device pool waits for it to import torch, start CUDA and zero the pool.
    timeout_s = DEVICE_ATTACH_TIMEOUT_S if pool != "host" else ATTACH_TIMEOUT_S
    return attach(holder, geometry, any_size, timeout_s, standby=standby, wait_s=wait_s)
