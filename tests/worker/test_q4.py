"""Small steps on a GGUF's own 4-bit weights: the blocks read exactly, the linear computes what
the dequantized matrix does, and the real model stays as close to float32 as bfloat16 does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.worker.conftest import make_worker
from tests.worker.kernel_checks import kernels_missing, require_kernels
from tests.worker.q4_cases import w4a8_reference
from worker.cpu import kernels
from worker.linear.base import Linear
from worker.linear.build import apply_plan, q4_facts, use_plan
from worker.linear.dense import OneDnn
from worker.linear.packing import float16_exact
from worker.model.gguf import (
    Q4Tensor,
    _q4_blocks,
    _q8_blocks,
    read_q4_tensors,
    unpermute_rope_rows,
)
from worker.plan import LinearPlan, Q4Fact, _onednn_packs, four_bit_linear

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="the 4-bit path runs on CPU with oneDNN"
)


def _ggml_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q4_0 or Q4_1 rows as ggml lays them out: (rows, blocks * bytes per block)."""
    rng = np.random.default_rng(seed)
    groups = cols // 32
    d = rng.uniform(0.01, 0.1, (rows, groups, 1)).astype(np.float16).view(np.uint8)
    header = [d]
    if kind == "Q4_1":
        header.append(rng.uniform(-0.5, 0.0, (rows, groups, 1)).astype(np.float16).view(np.uint8))
    nibbles = rng.integers(0, 256, (rows, groups, 16), dtype=np.uint8)
    return np.concatenate(header + [nibbles], axis=-1).reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_blocks_equal_ggufs_own_dequantize(kind):
    from gguf import GGMLQuantizationType, dequantize

    data = _ggml_blocks(kind, rows=6, cols=64, seed=1)
    want = dequantize(data, GGMLQuantizationType[kind]).reshape(6, 64)
    got = _q4_blocks(data, has_min=kind == "Q4_1")
    weight = (got.q.int() - 8) * got.scale.repeat_interleave(32, 1) + got.zero.repeat_interleave(
        32, 1
    )
    assert got.q.dtype == torch.uint8 and got.q.max() <= 15
    assert np.allclose(weight.numpy(), want, rtol=0, atol=1e-6)


def _q8_rows(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q8_0 rows as ggml lays them out: per block an f16 scale, then 32 int8."""
    rng = np.random.default_rng(seed)
    groups = cols // 32
    d = rng.uniform(0.001, 0.01, (rows, groups, 1)).astype(np.float16).view(np.uint8)
    q = rng.integers(-128, 128, (rows, groups, 32), dtype=np.int8).view(np.uint8)
    q[0, 0, :2] = np.array([-128, 127], dtype=np.int8).view(np.uint8)  # both ends of the range
    return np.concatenate([d, q], axis=-1).reshape(rows, -1)


def test_q8_blocks_as_two_4bit_halves_sum_to_ggufs_own_dequantize():
    from gguf import GGMLQuantizationType, dequantize

    data = _q8_rows(rows=5, cols=64, seed=6)
    want = dequantize(data, GGMLQuantizationType.Q8_0).reshape(5, 64)
    got = _q8_blocks(data)
    assert got.q.shape == (5, 128) and got.q.dtype == torch.uint8 and got.q.max() <= 15
    both = _dequantized(got, rounded=False)  # (5, 128)
    assert np.array_equal((both[:, :64] + both[:, 64:]).numpy(), want)


def _random_q4(rows: int, cols: int, seed: int) -> Q4Tensor:
    return _q4_blocks(_ggml_blocks("Q4_1", rows, cols, seed), has_min=True)


def _dequantized(q4: Q4Tensor, rounded: bool = True) -> torch.Tensor:
    """The float32 matrix; ``rounded``: the scales rounded to bfloat16 first, as the kernel
    reads them."""
    scale, zero = q4.scale, q4.zero
    if rounded:
        scale, zero = scale.bfloat16().float(), zero.bfloat16().float()
    return (q4.q.int() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)


def _planned(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    parts: list[Q4Tensor],
    max_tokens: int,
    w4a8: bool = False,
) -> tuple[Linear, LinearPlan]:
    """A linear of ``weight`` given the method the plan picks for its 4-bit ``parts`` on this
    CPU (``worker.plan.four_bit_linear``), and that choice."""
    layer = Linear.of(weight, bias)
    dtype = str(weight.dtype).removeprefix("torch.")
    big = "onednn" if _onednn_packs(dtype) else "dense"
    fact = Q4Fact(parts[0].q.shape[1] // layer.in_features, float16_exact(parts))
    choice = four_bit_linear(dtype, big, fact, max_tokens, w4a8)
    use_plan(layer, choice, parts)
    return layer, choice


def _packed(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """The same matrix as oneDNN's packed linear: what a big step runs without 4 bits."""
    layer = Linear.of(weight, bias)
    layer.use(OneDnn())
    return layer


@pytest.fixture(params=["nanoserve", "torch"])
def q4_kernel(request, monkeypatch, private_cache) -> bool:
    """Both 4-bit kernels: nanoserve's where this CPU has AVX512-BF16 (else, like the second
    case, torch's int4 kernel). Returns whether nanoserve's is expected."""
    if request.param == "torch":
        monkeypatch.setattr(kernels, "uses_bf16", lambda: False)
        return False
    return kernels_missing("bf16") is None


@needs_onednn
def test_q4_linear_computes_the_stacked_dequantized_matrix_on_small_steps_only(q4_kernel):
    parts = [_random_q4(96, 128, seed) for seed in (2, 3)]  # stacked by rows, as fuse does
    weight = torch.cat([_dequantized(p) for p in parts])  # (192, 128)
    bias = torch.randn(192, generator=torch.Generator().manual_seed(4)).bfloat16()
    layer, choice = _planned(weight.bfloat16(), bias.clone(), parts, max_tokens=3)
    assert choice == LinearPlan("onednn", "q4" if q4_kernel else "int4", 3)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    small = layer(x[:3]).float()
    want = F.linear(x[:3].float(), weight, bias.float())
    assert (small - want).abs().max().item() < 0.05 * want.abs().max().item()
    # A step of more tokens takes the bfloat16 matrix: exactly the packed linear's numbers.
    plain = _packed(weight.bfloat16(), bias.clone())
    assert torch.equal(layer(x), plain(x))
    assert not torch.equal(small, plain(x[:3]).float())  # the small step took another path


@needs_onednn
def test_a_float32_linear_rounds_its_small_steps_rows_for_torchs_4bit_kernel(monkeypatch):
    """A float32 model where ``auto`` chose float32 (no native bfloat16) and nanoserve's AVX2
    kernel is not built: small steps give float32 out of the 4-bit weights, from rows rounded to
    bfloat16 (torch's kernel is vectorized for those only); bigger steps keep the exact float32
    matrix."""
    monkeypatch.setattr(kernels, "uses_bf16", lambda: False)
    monkeypatch.setattr(kernels, "loaded", lambda: False)
    parts = [_random_q4(96, 128, seed) for seed in (2, 3)]
    weight = torch.cat([_dequantized(p) for p in parts])  # (192, 128)
    layer, choice = _planned(weight.clone(), None, parts, max_tokens=3)
    assert choice == LinearPlan("onednn", "int4", 3)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(5))
    small = layer(x[:3])
    assert small.dtype == torch.float32
    rounded = F.linear(x[:3].bfloat16().float(), weight)
    assert (small - rounded).abs().max().item() < 0.01 * rounded.abs().max().item()
    assert not torch.equal(small, F.linear(x[:3], weight))
    assert torch.equal(layer(x), _packed(weight.clone())(x))


def _assert_one_graph_for_2_and_12_rows(layer: Linear, x: torch.Tensor, eager: list) -> None:
    """``layer`` compiled with a dynamic batch gives ``eager``'s outputs for ``x[:2]`` and ``x``
    (12 rows), the second without recompiling."""
    torch._dynamo.reset()
    graph = torch.compile(layer.forward, fullgraph=True)
    with torch.inference_mode():
        small = x[:2].clone()
        torch._dynamo.mark_dynamic(small, 0)
        assert torch.equal(graph(small), eager[0])
        with torch.compiler.set_stance("fail_on_recompile"):
            assert torch.equal(graph(x.clone()), eager[1])


needs_q4a8 = pytest.mark.kernels("avx2")  # q4a8_linear_f32


@needs_onednn
@needs_q4a8
def test_a_float32_linear_takes_8bit_activations_on_small_steps_only_without_w4a8():
    """Where nanoserve's AVX2 kernel is built, a float32 linear's small steps are llama.cpp's
    4-bit x 8-bit dot (``q4_cases.w4a8_reference``); bigger ones keep the float32 matrix."""
    parts = [_random_q4(96, 128, seed) for seed in (2, 3)]
    q4 = Q4Tensor(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "zero")))
    weight = _dequantized(q4, rounded=False)  # (192, 128)
    bias = torch.randn(192, generator=torch.Generator().manual_seed(4))
    layer, choice = _planned(weight.clone(), bias.clone(), parts, max_tokens=3)
    assert choice == LinearPlan("onednn", "q4a8", 3) and layer.packed is not None
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(5))
    small = layer(x[:3]).double()
    want = w4a8_reference(x[:3], q4) + bias.double()
    assert ((small - want).abs() <= 1e-5 * want.abs().max()).all()
    # the packed float32 linear's own numbers
    assert torch.equal(layer(x), _packed(weight.clone(), bias.clone())(x))


@needs_onednn
@needs_q4a8
def test_with_w4a8_every_step_of_a_float32_linear_takes_8bit_activations_in_one_graph(
    private_cache,
):
    """With ``w4a8`` every step runs on the 4-bit weights and the float32 matrix goes; a
    compiled graph with a dynamic batch takes 2 rows and 12 without recompiling."""
    parts = [_random_q4(96, 128, seed) for seed in (2, 3)]
    q4 = Q4Tensor(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "zero")))
    layer, choice = _planned(_dequantized(q4, rounded=False), None, parts, 3, w4a8=True)
    assert str(choice) == "q4a8" and layer.weight is None and not hasattr(layer, "packed")
    x = torch.randn(12, 128, generator=torch.Generator().manual_seed(5))
    eager = [layer(x[:2]), layer(x)]
    for rows, got in zip((2, 12), eager, strict=True):
        want = w4a8_reference(x[:rows], q4)
        assert ((got.double() - want).abs() <= 1e-5 * want.abs().max()).all()
    _assert_one_graph_for_2_and_12_rows(layer, x, eager)


@needs_onednn
@needs_q4a8
def test_a_float32_q8_linear_feeds_both_halves_to_the_avx2_kernel():
    q8 = _q8_blocks(_q8_rows(rows=160, cols=96, seed=7))
    halves = _dequantized(q8, rounded=False)  # (160, 192)
    weight = halves[:, :96] + halves[:, 96:]
    layer, choice = _planned(weight.clone(), None, [q8], max_tokens=32)
    assert choice == LinearPlan("onednn", "q4a8", 32) and layer.q4_halves == 2
    x = torch.randn(33, 96, generator=torch.Generator().manual_seed(8))
    for rows in (1, 32):
        want = w4a8_reference(torch.cat([x[:rows], x[:rows]], dim=1), q8)
        assert ((layer(x[:rows]).double() - want).abs() <= 1e-5 * want.abs().max()).all()
    # 33 rows: the float32 matrix's own numbers
    assert torch.equal(layer(x), _packed(weight.clone())(x))


@needs_onednn
@pytest.mark.kernels("vnni")  # w4a8_linear
def test_w4a8_takes_the_big_steps_and_the_bfloat16_matrix_goes(private_cache):
    """With ``w4a8``, steps over ``max_tokens`` rows multiply the same 4-bit integers by 8-bit
    activations (the kernel's exact numbers, plus the bias); small steps stay on q4_linear;
    the bfloat16 matrix is dropped, since no step reads it any more."""
    parts = [_random_q4(96, 128, seed) for seed in (2, 3)]
    weight = torch.cat([_dequantized(p) for p in parts])  # (192, 128)
    bias = torch.randn(192, generator=torch.Generator().manual_seed(4)).bfloat16()
    layer, choice = _planned(weight.bfloat16(), bias.clone(), parts, 3, w4a8=True)
    assert choice == LinearPlan("w4a8", "q4", 3)
    assert layer.w4a8 is not None and layer.packed is None and layer.weight is None
    x = torch.randn(12, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    _, scale, low = layer.q4
    direct = torch.ops.nanoserve.w4a8_linear(x, layer.w4a8, scale, low)[:, :192] + bias
    assert torch.equal(layer(x), direct)
    want = F.linear(x.float(), weight, bias.float())
    assert (layer(x).float() - want).abs().max().item() < 0.05 * want.abs().max().item()
    small = torch.ops.nanoserve.q4_linear(x[:3], *layer.q4)[:, :192] + bias
    assert torch.equal(layer(x[:3]), small)
    # an 8-bit matrix (two halves) keeps its bfloat16 matrix for its big steps
    halves = [_q8_blocks(_q8_rows(rows=160, cols=96, seed=7))]
    q8, choice = _planned(torch.zeros(160, 96).bfloat16(), None, halves, 1, w4a8=True)
    assert choice == LinearPlan("onednn", "q4", 1) and q8.packed is not None


@needs_onednn
@pytest.mark.parametrize("w4a8", [False, True])
def test_a_compiled_4bit_linear_has_one_graph_for_every_batch(private_cache, w4a8):
    """The choice between the small steps' kernel and the big steps' is made at run time
    (``nanoserve::gguf_linear``), so a compiled graph with a dynamic batch takes 2 rows and 12
    without recompiling: a Python branch on the rows made a graph for each side, and the
    worker traced it on every start."""
    require_kernels("vnni" if w4a8 else "bf16")  # w4a8_linear, or q4_linear alone
    parts = [_random_q4(96, 128, seed) for seed in (2, 3)]
    weight = torch.cat([_dequantized(p) for p in parts]).bfloat16()
    layer, _ = _planned(weight, None, parts, 3, w4a8=w4a8)
    x = torch.randn(12, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    eager = [layer(x[:2]), layer(x)]
    _assert_one_graph_for_2_and_12_rows(layer, x, eager)


@needs_onednn
def test_q8_linear_feeds_both_halves_on_single_rows_only(q4_kernel):
    q8 = _q8_blocks(_q8_rows(rows=160, cols=96, seed=7))
    halves = _dequantized(q8)  # (160, 192)
    weight = halves[:, :96] + halves[:, 96:]  # (160, 96)
    layer, choice = _planned(weight.bfloat16(), None, [q8], max_tokens=1)
    assert choice == LinearPlan("onednn", "q4" if q4_kernel else "int4", 1)
    assert layer.q4_halves == 2
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(8)).bfloat16()
    one = layer(x[:1]).float()
    want = F.linear(x[:1].float(), weight)
    assert (one - want).abs().max().item() < 0.01 * want.abs().max().item()
    plain = _packed(weight.bfloat16())  # two rows take the bfloat16 matrix
    assert torch.equal(layer(x), plain(x)) and not torch.equal(one, plain(x[:1]).float())


@pytest.mark.slow
def test_real_q4_rows_are_the_gguf_rows_in_hugging_face_order():
    from gguf import GGUFReader, dequantize

    from models.files import resolve_model

    path = resolve_model(None).source
    tensors = read_q4_tensors(path, "llama", n_heads=9, n_kv_heads=3)
    # every layer's q, k, v, o, gate, up, down (Q4_1), and the embedding (Q8_0, tied lm head)
    assert len(tensors) == 30 * 7 + 1
    assert tensors["model.embed_tokens.weight"].q.shape == (49152, 2 * 576)
    raw = {t.name: t for t in GGUFReader(str(path)).tensors}
    for gguf_name, hf, heads in (
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", 9),
        ("blk.5.attn_k.weight", "model.layers.5.self_attn.k_proj.weight", 3),
        ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight", None),
    ):
        tensor = raw[gguf_name]
        want = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
        if heads:
            want = unpermute_rope_rows(want, heads)
        q4 = tensors[hf]
        got = (q4.q.int() - 8) * q4.scale.repeat_interleave(32, 1) + q4.zero.repeat_interleave(
            32, 1
        )
        assert got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-6)


@needs_onednn
def test_layers_take_only_4bit_matrices_and_the_lm_head_takes_8bit_for_one_row(tiny_dir):
    """The plan runs a kind on 4 bits only where every layer has its 4-bit matrices; an 8-bit
    one (two halves) pays for single rows only, so only the lm head takes it, for one row."""
    import dataclasses

    from worker.plan import resolve

    worker = make_worker(tiny_dir, dtype="bfloat16", q4_max_tokens=0, generic_path=True)
    layers = worker.spec.num_layers
    tensors = {"lm_head.weight": _q8_blocks(_q8_rows(256, 64, seed=11))}
    for index in range(layers):
        tensors[f"model.layers.{index}.self_attn.o_proj.weight"] = _q8_blocks(
            _q8_rows(64, 64, seed=9 + index)
        )
        tensors[f"model.layers.{index}.mlp.down_proj.weight"] = _random_q4(64, 128, 20 + index)
    del tensors[f"model.layers.{layers - 1}.mlp.down_proj.weight"]  # one layer lacks it
    facts = q4_facts(worker.model, tensors)
    assert set(facts) == {"o_proj", "lm_head"} and facts["o_proj"].halves == 2
    config = dataclasses.replace(worker.config, q4_max_tokens=8, generic_path=False)
    plan = resolve(config, device="cpu", dtype="bfloat16", head_dim=16, n_heads=4,
                   n_kv_heads=2, q4=facts)  # fmt: skip
    assert plan.linears["o_proj"].small is None  # 8-bit: left to bfloat16 in the layers
    head = plan.linears["lm_head"]
    assert head.small in ("q4", "int4") and head.max_rows == 1
    tensors[f"model.layers.{layers - 1}.mlp.down_proj.weight"] = _random_q4(64, 128, 99)
    facts = q4_facts(worker.model, tensors)
    plan = resolve(config, device="cpu", dtype="bfloat16", head_dim=16, n_heads=4,
                   n_kv_heads=2, q4=facts)  # fmt: skip
    assert plan.linears["down_proj"].small in ("q4", "int4")
    assert plan.linears["down_proj"].max_rows == 8
    assert apply_plan(worker.model, plan, tensors) == layers + 1
    assert worker.model.lm_head.q4_halves == 2


@pytest.mark.slow
def test_the_floor_counts_the_weight_form_each_batch_size_reads(tiny_dir):
    """``bench forward --profile``'s floor: 4-bit bytes where a step of that size takes the
    4-bit matrix, bfloat16 bytes where it does not, the lm head's 8-bit halves for one row,
    one embedding row per token, and the K/V attended over."""
    from nanoserve.bench.floor import read_bandwidth, step_floor

    worker = make_worker(tiny_dir, dtype="bfloat16", q4_max_tokens=0, generic_path=True)
    down = _random_q4(64, 128, seed=10)
    model = worker.model
    use_plan(model.model.layers[0].mlp.down_proj, _choice("bfloat16", 8), [down])
    use_plan(model.lm_head, _choice("bfloat16", 1), [_q8_blocks(_q8_rows(256, 64, seed=11))])
    spec = model.spec
    d, inter, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    per_layer = d * (spec.n_heads + 2 * spec.n_kv_heads) * hd + spec.n_heads * hd * d
    per_layer += 2 * inter * d + inter * d  # gate|up fused, then down
    plain = spec.num_layers * per_layer * 2  # bfloat16, each fused matrix counted once
    down_proj = model.model.layers[0].mlp.down_proj
    packed_down = getattr(down_proj, "q4", None) or down_proj.int4
    q4_bytes = sum(t.numel() * t.element_size() for t in packed_down)
    head = model.lm_head
    head_q8 = sum(t.numel() * t.element_size() for t in getattr(head, "q4", None) or head.int4)

    one, two, nine = (step_floor(model, b, 10, torch.bfloat16, 2e9) for b in (1, 2, 9))
    assert nine.linears == plain + 9 * d * 2  # nothing 4-bit at 9 rows
    assert two.linears == plain - inter * d * 2 + q4_bytes + 2 * d * 2
    assert q4_bytes < inter * d  # 4 bits and a scale and zero per 32: under a byte a weight
    assert one.head == head_q8 and two.head == spec.vocab_size * d * 2
    assert two.kv == 2 * 10 * spec.num_layers * 2 * spec.n_kv_heads * hd * 2
    assert two.seconds == (two.linears + two.head + two.kv) / 2e9
    assert read_bandwidth(repeats=1) > 1e8  # bytes a second: any machine reads 100 MB/s
    if kernels.uses_vnni():  # with --w4a8 the big steps read the integers a byte each
        down_proj = model.model.layers[1].mlp.down_proj  # its float weight is still there
        use_plan(down_proj, _choice("bfloat16", 8, w4a8=True), [down])
        scales = sum(t.numel() * t.element_size() for t in down_proj.q4[1:])
        nine = step_floor(model, 9, 10, torch.bfloat16, 2e9)
        assert nine.linears == plain - inter * d * 2 + inter * d + scales + 9 * d * 2
        assert (
            step_floor(model, 2, 10, torch.bfloat16, 2e9).linears
            == two.linears + q4_bytes - inter * d * 2
        )


def _choice(dtype: str, rows: int, w4a8: bool = False) -> LinearPlan:
    big = "onednn" if _onednn_packs(dtype) else "dense"
    return four_bit_linear(dtype, big, Q4Fact(1, True), rows, w4a8)
