"""``WorkerConfig``: everything the worker process needs to load a model and size its cache."""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "bfloat16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class WorkerConfig:
    """How to build a worker. ``None`` fields take a default worked out at load time.

    ``model``: a model name or path for ``models.files.resolve_model`` (None: default).
    ``dtype``: ``auto`` is bfloat16 where the device computes it natively (CUDA; CPUs with
    AVX512-BF16 or AMX), else float32 (``worker.plan.resolve_dtype``).
    ``num_blocks`` wins over ``kv_cache_memory`` (bytes); with neither, the budget comes from
    free RAM (CPU) or free GPU memory. ``max_model_len`` defaults to the model's
    ``max_position_embeddings``, capped at 8192. ``num_threads`` sets torch's intra-op threads;
    None keeps torch's default, one per physical core, which measured best even beside the
    frontend and scheduler processes (they sleep while the worker computes).
    ``q4_max_tokens``: on CPU in bfloat16, or in the float32 that ``auto`` picks on a CPU without
    native bfloat16, with a GGUF whose matrices are Q4_0 or Q4_1, steps of at most this many
    tokens run on the file's own 4-bit weights (0: never). A float32 model's rows are quantized
    to 8 bits for them (``csrc/q4a8_linear_f32.cpp``, AVX2), or rounded to bfloat16 where that
    is not built. An explicit float32 never does: it is the exact path.
    ``w4a8``: there, where the CPU also has AVX512-VNNI, the MLP's bigger steps run on the same
    4-bit weights times activations quantized to 8 bits in groups of 32 (llama.cpp's numerics
    for a Q4_1 matrix), not on bfloat16 matrices (``csrc/w4a8_linear.cpp``). In ``auto``'s
    float32, every step of every layer's linears does (``csrc/q4a8_linear_f32.cpp``).
    ``kv_cache_dtype``: the K/V pool's dtype. ``auto`` is float16 under the float32 that ``auto``
    picks on a CPU, where the AVX2 decode kernel reads it (``csrc/decode_attention_f32.cpp``;
    llama.cpp's default f16 K/V): half the bytes a decode reads, twice the blocks in the same
    memory. Elsewhere ``auto`` is the model's dtype, and an explicit value must be that dtype
    or float16 under such a float32 model.
    ``compile``: on CPU, decode-only steps of at most 32 rows run as one ``torch.compile``d graph
    (``worker.compiled.decode``); None: wherever it pays (CPU, off the generic path, torch >= 2.13).
    ``adapt_threads``: on CPU with one rank, drop to one thread while another process holds a
    core, and come back when it is free (``worker.cpu.threads``).
    ``generic_path``: run on CPU exactly the code CUDA runs: the torch attention backend, plain
    ``F.linear`` weights (no oneDNN packing, no 4-bit matrices) and torch's argmax, none of
    ``worker.cpu.kernels``, and decode steps through the graph runner (``worker.step.graphs``),
    whose CPU adapter replays each bucket's function eagerly. It tests that path where there is no
    GPU.
    ``enforce_eager``: every step runs eagerly: no CUDA graphs (``worker.step.graphs``), no compiled
    CPU steps.
    """

    model: str | None = field(
        default=None,
        metadata={
            "help": "a .gguf file or a Hugging Face directory (config.json, *.safetensors)",
            "shown": "SmolLM2-135M-Instruct",
            "processes": ("worker", "frontend"),
        },
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "auto: bfloat16 where the device computes it natively, else float32; "
            "float32: the exact path",
            "choices": DTYPES,
        },
    )
    device: str = field(
        default="auto",
        metadata={"help": "auto: cuda where torch sees a GPU, else cpu", "choices": DEVICES},
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    num_blocks: int | None = field(
        default=None,
        metadata={"help": "KV pool size in blocks, given outright", "shown": "from the budget"},
    )
    kv_cache_memory: int | None = field(
        default=None,
        metadata={
            "help": "KV pool budget (2GiB, 512MiB, bytes)",
            "shown": "CPU: 1/4 of RAM, at most 4 GiB; CUDA: 80% of free",
            "parse": "bytes",
        },
    )
    num_slots: int = field(
        default=128, metadata={"help": "cache rows: the most requests running at once"}
    )
    max_model_len: int | None = field(
        default=None,
        metadata={"help": "longest prompt + output", "shown": "the model's, at most 8192"},
    )
    seed: int = field(default=0, metadata={"help": "seeds the draws of requests that give none"})
    num_threads: int | None = field(
        default=None,
        metadata={
            "help": "torch threads for the forward",
            "shown": "the CPUs this process may use",
            "flag": "--threads",
        },
    )
    q4_max_tokens: int = field(
        default=8,
        metadata={
            "help": "CPU, Q4_0/Q4_1 GGUF: steps of at most this many tokens run on the file's "
            "4-bit weights (0: never)"
        },
    )
    w4a8: bool = field(
        default=True,
        metadata={
            "help": "CPU with AVX512-VNNI, or auto's float32: 4-bit weights times 8-bit "
            "activations in bigger steps too (llama.cpp's numerics)"
        },
    )
    shared_kv_pool: bool = field(
        default=False,
        metadata={
            "help": "take the KV pool from the pool holder (nanoserve kv-holder): a shared "
            "file on CPU, device memory through a CUDA IPC handle on a GPU, so a worker's death "
            "keeps its K/V and costs only the steps in flight (docs/kv_pool.md)"
        },
    )
    standby_workers: int = field(
        default=0,
        metadata={
            "help": "with --shared-kv-pool, one rank: more worker processes, each with the "
            "model loaded and idle, the first to take the pool over when the active worker dies"
        },
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "the K/V pool's dtype; auto: float16 under auto's float32 on a CPU, "
            "else the model's",
            "choices": KV_CACHE_DTYPES,
        },
    )
    compile: bool | None = field(
        default=None,
        metadata={
            "help": "CPU: decode steps of at most 32 rows as one torch.compile'd graph, "
            "built in the background",
            "shown": "on where it pays",
        },
    )
    generic_path: bool = field(
        default=False,
        metadata={"help": "run on CPU exactly the code CUDA runs (none of nanoserve's kernels)"},
    )
    enforce_eager: bool = field(
        default=False,
        metadata={
            "help": "run every step eagerly: no CUDA graphs for decode steps, no compiled CPU steps"
        },
    )
    adapt_threads: bool = field(
        default=True,
        metadata={
            "help": "CPU: one thread while another process holds a core, until it is free again"
        },
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.standby_workers < 0:
            raise ValueError(f"standby_workers must be >= 0, got {self.standby_workers!r}")
        if self.standby_workers and not self.shared_kv_pool:
            raise ValueError("standby workers take over a shared pool: add --shared-kv-pool")
        _positive("block_size", self.block_size)
        _positive("num_slots", self.num_slots)
        for name in ("num_blocks", "kv_cache_memory", "max_model_len", "num_threads"):
            value = getattr(self, name)
            if value is not None:
                _positive(name, value)
        if not isinstance(self.q4_max_tokens, int) or self.q4_max_tokens < 0:
            raise ValueError(f"q4_max_tokens must be >= 0, got {self.q4_max_tokens!r}")
        if self.generic_path and self.compile is True:
            raise ValueError("generic_path runs what CUDA runs, and CUDA does not compile")
        if self.enforce_eager and self.compile is True:
            raise ValueError("enforce_eager runs every step eagerly: it cannot compile")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


_MAX_DEFAULT_LEN = 8192


def resolve_max_model_len(config: WorkerConfig, model_config) -> int:
    """The worker's context limit: ``config.max_model_len``, checked against the model's
    ``max_position_embeddings``, or the smaller of that and 8192 when unset."""
    limit = getattr(model_config, "max_position_embeddings", None) or _MAX_DEFAULT_LEN
    if config.max_model_len is None:
        return min(limit, _MAX_DEFAULT_LEN)
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's limit of {limit} positions"
        )
    return config.max_model_len
