"""``Plan``: how this worker runs its steps, decided once, at start.

Every choice that depends on the device, the dtype, the CPU's instructions, the kernels this
machine built or the model file's 4-bit matrices is made here (``resolve``), from the config and
those facts; nothing else in the worker asks them. The model's layers take their pointwise ops
(``worker.model.ops``), each linear its method (``worker.linear.build``), the attention its
backend (``worker.attention.make_backend``) and the sampler its argmax from what the plan names.
The worker logs the plan, announces it in ``WorkerReady`` (``summary``), and /metrics and the
web page show it.

Adding a backend is one more value of one field and one entry in the table that builds it: CUDA
runs Triton's attention where triton imports, plain weights, and its decode steps in CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch

from worker.config import WorkerConfig
from worker.cpu import kernels
from worker.cpu.machine import usable_cpus
from worker.plan_attention import attention_choice, kv_dtype_choice, triton_runs

# What /proc/cpuinfo calls the instructions that compute in bfloat16 natively.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
LINEAR_KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
MLP_KINDS = ("gate_up_proj", "down_proj")
ALL_ROWS = 1 << 62  # a small-step method's row limit when it runs every step
# torch.ops.nanoserve.q4_linear's most rows (csrc/q4_linear.cpp's kMaxRows).
Q4_KERNEL_MAX_ROWS = 8
# The lm head's GGUF matrix (usually Q8_0, so two 4-bit halves) runs 4-bit for one row only: twice
# the columns pay for themselves at one row and not beyond. In a float32 model too: the head's
# 8-bit activations in many-row steps lower the agreement with float32 below llama.cpp's
# (docs/performance.md).
LM_HEAD_Q4_MAX_ROWS = 1


@dataclass(frozen=True)
class LinearPlan:
    """One kind of linear: steps of at most ``max_rows`` rows run ``small`` (a 4-bit method:
    "q4", "q4a8", "int4"; None: none), the others ``big`` ("dense", "onednn", "w4a8", "q4a8")."""

    big: str = "dense"
    small: str | None = None
    max_rows: int = 0

    def __str__(self) -> str:
        if self.small is None:
            return self.big
        if self.max_rows >= ALL_ROWS:
            return self.small
        return f"{self.small}<={self.max_rows}|{self.big}"


@dataclass(frozen=True)
class Q4Fact:
    """What the model file holds of one linear kind in 4 bits: in every layer (``halves`` 2 for
    an 8-bit matrix held as two 4-bit halves), and whether its scales and lows are exact in
    float16, as nanoserve's 4-bit kernels store them."""

    halves: int
    exact: bool


@dataclass(frozen=True)
class Plan:
    """How the worker runs its steps. See the module docstring; ``summary`` names every field."""

    device: str  # "cpu" | "cuda"
    dtype: str  # what the model computes in: "float32" | "bfloat16"
    kv_dtype: str  # the K/V pool's: the model's, or "float16" under a CPU kernel's float32
    kv_pool: str  # "host": mapped, backed behind serving | "device": zeroed at start
    attention: str  # "torch" | "cpu-bf16" | "cpu-f32" | "triton"
    prefill: str  # "sdpa" | "kernel": how a kernel backend's prefills attend
    linears: dict[str, LinearPlan]  # LINEAR_KINDS -> method
    norm: str  # "torch" | "kernel" (bfloat16) | "kernel-f32"
    activation: str  # the SwiGLU's silu(gate) * up: "torch" | "kernel" | "kernel-f32"
    rotary: str  # "torch" | "kernel" (bfloat16)
    argmax: str  # the sampler's greedy choice: "torch" | "kernel"
    compile: str  # decode steps: "eager" | "inductor" (worker.compiled) | "cuda-graphs" (.graphs)
    threads: int  # torch's intra-op threads
    adapt_threads: bool  # drop to one thread beside a busy neighbour (worker.cpu.threads)
    pin_memory: bool = False  # step inputs and outputs in pinned host memory (worker.step.pack)

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return getattr(torch, self.kv_dtype)

    def load_kernels(self) -> None:
        """Load nanoserve's CPU kernels if the plan runs any (a plan handed over, not resolved
        here, has not loaded them); ValueError where they, or Triton's attention, cannot run."""
        choices = self.summary()
        if self.attention == "triton":  # its prefill "kernel" is Triton's, not a C++ one
            del choices["prefill"]
            if not triton_runs(self.device):
                raise ValueError(
                    f"the plan's Triton attention cannot run on {self.device} here (triton "
                    "missing, or on CPU without TRITON_INTERPRET=1)"
                )
        uses = any(n.startswith(("cpu-", "kernel", "q4", "w4a8")) for n in choices.values())
        if uses and not kernels.loaded():
            raise ValueError("the plan runs nanoserve's CPU kernels, which are not built here")

    def to_json(self) -> str:
        """The plan as JSON (``from_json`` reads it back): for a child that must run the same
        plan, and for the compiled graphs' cache key."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan ``to_json`` wrote."""
        fields = json.loads(text)
        fields["linears"] = {kind: LinearPlan(**c) for kind, c in fields["linears"].items()}
        return cls(**fields)

    def summary(self) -> dict[str, str]:
        """Every field as text: the worker's log line, ``WorkerReady.plan`` and /metrics."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, dict):
                out.update({kind: str(choice) for kind, choice in value.items()})
            else:
                out[field.name] = str(value).lower()  # True -> "true", as the rest reads
        return out


def resolve_device(config: WorkerConfig) -> str:
    """``cuda`` or ``cpu``: ``auto`` becomes ``cuda`` when torch sees a GPU."""
    if config.device != "auto":
        return config.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(config: WorkerConfig, device: str) -> str:
    """``float32`` or ``bfloat16``: ``auto`` is bfloat16 where the device computes it natively
    (CUDA that supports it; a CPU with AVX512-BF16 or AMX), else float32."""
    if config.dtype != "auto":
        return config.dtype
    if device == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if set(BF16_CPU_FLAGS) & kernels.cpu_flags() else "float32"


def collective_backend(device: str, index: int) -> str:
    """A tensor-parallel rank's collectives: NCCL on GPU ``index`` of this host (made the
    current device), else gloo."""
    if device == "cuda":
        torch.cuda.set_device(index)
        return "nccl"
    return "gloo"


def resolve_threads(config: WorkerConfig, local_size: int) -> int:
    """torch's intra-op threads: ``config.num_threads``, or the CPUs this process may use,
    shared between the host's ranks."""
    return config.num_threads or max(1, usable_cpus() // local_size)


def wants_4bit(config: WorkerConfig, device: str, dtype: str, group_size: int) -> bool:
    """Whether the plan may run linears on the model file's 4-bit matrices, so the worker reads
    them: on CPU, off the generic path, one rank (their matrices are not sharded), in bfloat16 or
    the float32 that ``auto`` picks (an explicit float32 is the exact path)."""
    cpu_fast = device == "cpu" and not config.generic_path and group_size == 1
    return cpu_fast and config.q4_max_tokens > 0 and (dtype == "bfloat16" or config.dtype == "auto")


def resolve(
    config: WorkerConfig,
    *,
    device: str,
    dtype: str,
    head_dim: int,
    n_heads: int,
    n_kv_heads: int,
    q4: dict[str, Q4Fact],
    group_size: int = 1,
    local_size: int = 1,
) -> Plan:
    """The plan for this config on this machine, for a shard with these heads whose file holds
    the 4-bit matrices ``q4`` (kind -> fact). ValueError for a config it cannot run."""
    cpu_fast = device == "cpu" and not config.generic_path
    own = cpu_fast and kernels.available()  # the AVX-512 kernels (bfloat16, argmax)
    own_f32 = cpu_fast and kernels.loaded()  # the AVX2 ones (float32)
    auto_f32 = config.dtype == "auto" and dtype == "float32"
    gpu = device == "cuda" and not config.generic_path
    attention, prefill = attention_choice(own, own_f32, gpu, dtype, head_dim, n_heads, n_kv_heads)
    pointwise = "kernel" if own and dtype == "bfloat16" else "torch"
    if auto_f32 and own_f32:
        pointwise = "kernel-f32"
    return Plan(
        device=device,
        dtype=dtype,
        kv_dtype=kv_dtype_choice(config, dtype, attention),
        kv_pool="host" if device == "cpu" else "device",
        attention=attention,
        prefill=prefill,
        linears=_linears(config, device, dtype, q4, group_size),
        norm=pointwise,
        activation=pointwise,
        rotary="kernel" if own and dtype == "bfloat16" else "torch",
        argmax="kernel" if own else "torch",
        compile=_compile(config, device, group_size),
        threads=resolve_threads(config, local_size),
        adapt_threads=config.adapt_threads and device == "cpu" and group_size == 1,
        pin_memory=device == "cuda",
    )


def _linears(
    config: WorkerConfig, device: str, dtype: str, q4: dict[str, Q4Fact], group_size: int
) -> dict[str, LinearPlan]:
    """Each kind's method. On CPU, weights oneDNN can pack are packed; where the file has 4-bit
    matrices, small steps run on them (and with ``w4a8``, bigger ones too: the MLP's in
    bfloat16, every kind's in ``auto``'s float32)."""
    cpu_fast = device == "cpu" and not config.generic_path
    big = "onednn" if cpu_fast and _onednn_packs(dtype) else "dense"
    plans = {kind: LinearPlan(big) for kind in LINEAR_KINDS}
    if not wants_4bit(config, device, dtype, group_size):
        return plans
    w4a8_kinds = MLP_KINDS if dtype == "bfloat16" else LINEAR_KINDS
    for kind, fact in q4.items():
        head = kind == "lm_head"
        if fact.halves != 1 and not head:  # an 8-bit matrix pays for single rows only
            continue
        rows = min(config.q4_max_tokens, LM_HEAD_Q4_MAX_ROWS) if head else config.q4_max_tokens
        w4a8 = config.w4a8 and not head and kind in w4a8_kinds
        plans[kind] = four_bit_linear(dtype, big, fact, rows, w4a8)
    return plans


def four_bit_linear(dtype: str, big: str, fact: Q4Fact, rows: int, w4a8: bool) -> LinearPlan:
    """A 4-bit kind's method: the AVX2 q4a8 kernel for float32 rows (every step with
    ``w4a8``); nanoserve's bfloat16 4-bit kernel for few rows, with ``w4a8`` on AVX512-VNNI
    above them; torch's int4 kernel elsewhere."""
    if dtype == "float32" and kernels.loaded() and fact.exact:
        return LinearPlan("q4a8", "q4a8", ALL_ROWS) if w4a8 else LinearPlan(big, "q4a8", rows)
    if rows <= Q4_KERNEL_MAX_ROWS and kernels.available() and kernels.uses_bf16() and fact.exact:
        if w4a8 and fact.halves == 1 and kernels.uses_vnni():
            return LinearPlan("w4a8", "q4", rows)
        return LinearPlan(big, "q4", rows)
    return LinearPlan(big, "int4", rows)


def _onednn_packs(dtype: str) -> bool:
    """Whether oneDNN can pack a ``dtype`` weight on this CPU: float32 wherever torch has oneDNN;
    bfloat16 only with AVX512 (BW, VL, DQ) or AVX-NE-CONVERT (on a plain AVX2 CPU the reorder
    raises rather than fall back)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == "bfloat16":
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == "float32"


def _compile(config: WorkerConfig, device: str, group_size: int) -> str:
    """``eager`` with ``enforce_eager``; ``cuda-graphs`` for the code CUDA runs with one rank (on
    CUDA; on CPU's generic path the graph runner's adapter replays eagerly: ``worker.step.graphs``);
    ``inductor`` where asked, or by default where it pays (CPU, one rank, a torch that compiles
    the graph). ValueError where asked and impossible."""
    if config.compile and device != "cpu":
        raise ValueError(f"compile runs on CPU only, not on {device}")
    if config.enforce_eager or (group_size > 1 and not config.compile):
        return "eager"
    if device == "cuda" or config.generic_path:
        return "cuda-graphs"
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    new_enough = (major, minor) >= (2, 13)
    if not config.compile:
        return "inductor" if config.compile is None and new_enough else "eager"
    if group_size > 1:
        raise ValueError("compile runs one rank only: tensor-parallel steps run eagerly")
    if not new_enough:
        raise ValueError(f"compile needs torch >= 2.13, this is {torch.__version__}")
    return "inductor"
