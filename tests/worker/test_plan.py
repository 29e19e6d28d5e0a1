"""The worker's plan (``worker.plan``): resolved once from the config, the device, the CPU's
flags and the model file; every layer's ops come from it, and nothing else asks."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.worker.conftest import make_worker
from tests.worker.driver import Driver, Request
from worker import plan as plan_module
from worker import plan_attention
from worker.config import WorkerConfig
from worker.cpu import kernels
from worker.plan import LINEAR_KINDS, LinearPlan, Plan, Q4Fact, resolve

ROOT = Path(__file__).resolve().parents[2]


def _ops_run(worker) -> set[str]:
    """The operators one prefill and a few decodes of ``worker`` call (torch's profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        Driver(worker, eos=[]).run([Request("r", list(range(3, 20)), 3)])
    return {event.name for event in prof.events()}


def test_the_worker_announces_and_runs_its_plan(tiny_dir):
    worker = make_worker(tiny_dir, dtype="float32")
    assert worker.ready().plan == worker.plan.summary()
    summary = worker.plan.summary()
    assert {"device", "dtype", "kv_dtype", "attention", "norm", "compile", "threads"} <= set(
        summary
    )
    assert set(LINEAR_KINDS) <= set(summary)
    assert Plan.from_json(worker.plan.to_json()) == worker.plan


@pytest.mark.kernels("avx512")
def test_changing_the_plan_changes_what_runs_and_nothing_else_does(tiny_dir):
    """One bfloat16 plan, then the same plan with one choice changed at a time: each change
    shows in the operators a step calls, and only there."""
    planned = make_worker(tiny_dir, dtype="bfloat16").plan
    assert planned.attention == "cpu-bf16" and planned.argmax == "kernel"
    assert planned.norm == planned.activation == planned.rotary == "kernel"
    assert str(planned.linears["qkv_proj"]) == "onednn"  # the tiny model has no 4-bit weights
    ran = _ops_run(make_worker(tiny_dir, dtype="bfloat16", plan=planned))
    kernels_ran = {"nanoserve::rms_norm", "nanoserve::silu_mul", "nanoserve::rotary_"}
    assert kernels_ran | {"nanoserve::decode_attention", "nanoserve::argmax"} <= ran
    assert "mkldnn::_linear_pointwise" in ran and "aten::linear" not in ran
    changes = {
        "pointwise": (
            dict(norm="torch", activation="torch", rotary="torch"),
            {"aten::rms_norm", "aten::silu_"},
            kernels_ran,
        ),
        "attention": (
            dict(attention="torch", prefill="sdpa"),
            {"aten::bmm", "aten::scaled_dot_product_attention"},
            {"nanoserve::decode_attention", "nanoserve::prefill_attention"},
        ),
        "argmax": (dict(argmax="torch"), {"aten::argmax"}, {"nanoserve::argmax"}),
        "linears": (
            dict(linears={kind: LinearPlan("dense") for kind in LINEAR_KINDS}),
            {"aten::linear"},
            {"mkldnn::_linear_pointwise"},
        ),
    }
    for name, (fields, appears, goes) in changes.items():
        changed = dataclasses.replace(planned, **fields)
        now = _ops_run(make_worker(tiny_dir, dtype="bfloat16", plan=changed))
        assert appears <= now, (name, appears - now)
        assert not goes & now, (name, goes & now)
        for other, signature in SIGNATURES.items():  # the other choices run as before
            if other != name:
                assert now & signature == ran & signature, (name, other)


# The operators that tell each choice's implementations apart.
SIGNATURES = {
    "pointwise": {
        "nanoserve::rms_norm", "nanoserve::silu_mul", "nanoserve::rotary_", "aten::rms_norm",
        "aten::silu_",
    },
    "attention": {
        "nanoserve::decode_attention", "nanoserve::prefill_attention", "aten::bmm",
        "aten::scaled_dot_product_attention",
    },
    "argmax": {"nanoserve::argmax", "aten::argmax"},
    "linears": {"mkldnn::_linear_pointwise", "aten::linear"},
}  # fmt: skip


def test_a_plan_the_machine_cannot_run_is_refused_at_start(tiny_dir, monkeypatch):
    planned = make_worker(tiny_dir, dtype="float32", generic_path=True).plan
    kernel_plan = dataclasses.replace(planned, argmax="kernel")
    monkeypatch.setattr(kernels, "loaded", lambda: False)
    with pytest.raises(ValueError, match="not built here"):
        make_worker(tiny_dir, dtype="float32", plan=kernel_plan)


def _resolve(monkeypatch, *, flags=(), built=True, bf16=True, vnni=True, **config) -> Plan:
    """The plan on a simulated CPU: its flags, and which kernels are built (``built``: the AVX2
    set; AVX-512 with ``avx512f`` in the flags)."""
    avx512 = built and "avx512f" in flags
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(kernels, "loaded", lambda: built)
    monkeypatch.setattr(kernels, "available", lambda: avx512)
    monkeypatch.setattr(kernels, "uses_bf16", lambda: avx512 and bf16)
    monkeypatch.setattr(kernels, "uses_vnni", lambda: avx512 and bf16 and vnni)
    for name in ("decode_attention_supports", "decode_attention_f32_supports"):
        monkeypatch.setattr(torch.ops.nanoserve, name, lambda *args: True, raising=False)
    for name in ("prefill_attention_supports", "prefill_attention_f32_supports"):
        monkeypatch.setattr(torch.ops.nanoserve, name, lambda *args: True, raising=False)
    monkeypatch.setattr(plan_module, "_onednn_packs", lambda dtype: True)
    device = config.pop("device", "cpu")
    group_size = config.pop("group_size", 1)
    settings = WorkerConfig(device=device, **config)
    dtype = plan_module.resolve_dtype(settings, device)
    q4 = {kind: Q4Fact(2 if kind == "lm_head" else 1, True) for kind in LINEAR_KINDS}
    return resolve(
        settings, device=device, dtype=dtype, head_dim=64, n_heads=9, n_kv_heads=3, q4=q4,
        group_size=group_size,
    )  # fmt: skip


def test_a_zen5_runs_bfloat16_kernels_4bit_small_steps_and_w4a8_mlps(monkeypatch):
    plan = _resolve(monkeypatch, flags=("avx2", "avx512f", "avx512_bf16", "avx512_vnni"))
    assert (plan.dtype, plan.kv_dtype, plan.attention, plan.prefill) == (
        "bfloat16", "bfloat16", "cpu-bf16", "kernel",
    )  # fmt: skip
    assert plan.norm == plan.activation == plan.rotary == plan.argmax == "kernel"
    assert str(plan.linears["qkv_proj"]) == "q4<=8|onednn"
    assert str(plan.linears["gate_up_proj"]) == "q4<=8|w4a8"
    assert str(plan.linears["lm_head"]) == "q4<=1|onednn"
    assert plan.compile == "inductor"


def test_a_zen3_runs_autos_float32_on_avx2_kernels_and_q4a8(monkeypatch):
    plan = _resolve(monkeypatch, flags=("avx2", "fma", "f16c"))
    assert (plan.dtype, plan.kv_dtype, plan.attention) == ("float32", "float16", "cpu-f32")
    assert plan.norm == plan.activation == "kernel-f32" and plan.rotary == plan.argmax == "torch"
    assert all(str(plan.linears[kind]) == "q4a8" for kind in LINEAR_KINDS[:-1])
    assert str(plan.linears["lm_head"]) == "q4a8<=1|onednn"
    exact = _resolve(monkeypatch, flags=("avx2", "fma", "f16c"), dtype="float32")
    assert exact.kv_dtype == "float32" and exact.norm == "torch"
    assert all(choice.small is None for choice in exact.linears.values())  # the exact path


def test_the_generic_path_cuda_and_tensor_parallel_ranks_keep_plain_weights(monkeypatch):
    """CUDA runs the generic plan but for its attention: Triton's kernels (with triton
    installed, as the test extra installs it)."""
    zen5 = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni")
    generic = _resolve(monkeypatch, flags=zen5, generic_path=True)
    assert (generic.attention, generic.argmax, generic.norm) == ("torch", "torch", "torch")
    assert all(str(choice) == "dense" for choice in generic.linears.values())
    assert generic.compile == "cuda-graphs" and generic.kv_pool == "host"
    assert not generic.pin_memory
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    cuda = _resolve(monkeypatch, flags=zen5, device="cuda")
    assert (cuda.attention, cuda.prefill, cuda.kv_dtype) == ("triton", "kernel", "bfloat16")
    as_cpu = dict(kv_pool="host", device="cpu", pin_memory=False, attention="torch", prefill="sdpa")
    as_cpu.update(threads=generic.threads, adapt_threads=generic.adapt_threads)
    assert dataclasses.replace(cuda, **as_cpu) == generic
    assert cuda.kv_pool == "device" and not cuda.adapt_threads and cuda.pin_memory
    ranks = _resolve(monkeypatch, flags=zen5, group_size=2)
    assert all(choice.small is None for choice in ranks.linears.values())
    assert ranks.compile == "eager"
    assert _resolve(monkeypatch, device="cuda", group_size=2).compile == "eager"


@pytest.mark.parametrize(
    "device,config,compiles",
    [
        ("cuda", {}, "cuda-graphs"),
        ("cuda", dict(enforce_eager=True), "eager"),
        ("cuda", dict(compile=False), "cuda-graphs"),  # --no-compile is the CPU's inductor
        ("cpu", dict(generic_path=True, enforce_eager=True), "eager"),
        ("cpu", dict(enforce_eager=True), "eager"),
        ("cpu", dict(compile=False), "eager"),
    ],
)
def test_cuda_graphs_by_default_and_enforce_eager_turns_them_off(
    monkeypatch, device, config, compiles
):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert _resolve(monkeypatch, device=device, **config).compile == compiles


def test_cuda_keeps_torchs_attention_without_triton_or_on_the_generic_path(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    generic = _resolve(monkeypatch, device="cuda", generic_path=True)
    assert (generic.attention, generic.prefill) == ("torch", "sdpa")
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    without = _resolve(monkeypatch, device="cuda")
    assert (without.attention, without.prefill) == ("torch", "sdpa")
    # Query heads that do not group over the KV heads: torch's, triton or not.
    assert plan_attention.attention_choice(False, False, True, "bfloat16", 64, 9, 2)[0] == "torch"


def test_a_triton_plan_on_cpu_runs_only_under_the_interpreter(tiny_dir, monkeypatch):
    """A handed-over plan naming Triton's attention on CPU is refused at start unless Triton
    interprets its kernels; it needs no C++ kernel for its prefill "kernel"."""
    generic = make_worker(tiny_dir, dtype="float32", generic_path=True).plan
    plan = dataclasses.replace(generic, attention="triton", prefill="kernel")
    monkeypatch.setattr(kernels, "loaded", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="Triton attention cannot run on cpu here"):
        plan.load_kernels()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    plan.load_kernels()  # Triton interprets: no C++ kernel asked for
    with pytest.raises(ValueError, match="not built here"):
        dataclasses.replace(plan, argmax="kernel").load_kernels()


def test_impossible_configs_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="compile runs on CPU only"):
        _resolve(monkeypatch, device="cuda", compile=True)
    with pytest.raises(ValueError, match="enforce_eager runs every step eagerly"):
        _resolve(monkeypatch, compile=True, enforce_eager=True)
    with pytest.raises(ValueError, match="kv_cache_dtype float16 needs"):
        _resolve(monkeypatch, flags=("avx2",), dtype="float32", kv_cache_dtype="float16",
                 generic_path=True)  # fmt: skip


# What asks the machine: its CPU's flags, the kernels built, the device, or the dtype, outside
# the plan (and the kernels' loader, which builds for the flags).
CAPABILITY = re.compile(
    r"cpu_flags\(|uses_bf16\(|uses_vnni\(|kernels\.(available|loaded)\(|cpu_supports"
    r"|cuda\.is_available|is_bf16_supported|is_dynamo_compiling|is_compiling\("
    r"|\.dtype\s*[!=]=|dtype\s*==\s*torch\.|\bdevice\s*[!=]=|\.type\s*==\s*\"(cpu|cuda)\""
    r"|_is_mkldnn_bf16_supported"
)
ALLOWED = {"worker/plan.py", "worker/plan_attention.py", "worker/cpu/kernels.py"}


def capability_checks(text: str) -> list[str]:
    """The lines of ``text`` (code, comments and docstrings excluded) that ask the machine."""
    found = []
    for line in text.splitlines():
        code = line.split("#", 1)[0]
        if CAPABILITY.search(code) and not code.strip().startswith(('"', "'", "``")):
            found.append(line.strip())
    return found


def test_no_capability_check_outside_the_plan():
    offenders = {}
    for package in ("worker", "frontend", "scheduler", "protocol", "models"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name in ALLOWED:
                continue
            found = capability_checks(path.read_text())
            if found:
                offenders[name] = found
    # numpy and zmq values the code checks are not the machine's: the grammar's bitmask dtype
    assert set(offenders) <= {"worker/grammar/llguidance_backend.py"}, offenders


@pytest.mark.parametrize(
    "line",
    [
        "    if kernels.available() and x.dim() == 2:",
        "    own = dtype == torch.bfloat16",
        "    if self.device == 'cpu':",
        "        if torch.compiler.is_dynamo_compiling():",
        "    flags = cpu_flags()",
        '    if tensor.device.type == "cuda":',
    ],
)
def test_the_capability_check_finder_fires(line):
    assert capability_checks(f"def f():\n{line}\n    return 1\n") == [line.strip()]
