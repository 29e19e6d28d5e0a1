"""Where the compiled decode step's fused loops run: a loop of a fixed small size on the calling
thread, a loop whose size follows the batch in an OpenMP parallel region
(worker/compiled/decode.py's
``_serial_small_kernels``). Counted in the C++ inductor generates for a small norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from worker.compiled import decode as compiled

# The options the worker compiles with that decide the loops' threads.
OPTIONS = {"cpp.dynamic_threads": True, "fx_graph_cache": False}


def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, 1e-5) * 2 + 1


def parallel_regions(rows: int, width: int, dynamic: bool = False) -> int:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, width, generator=gen), torch.randn(width, generator=gen)
    if dynamic:
        torch._dynamo.mark_dynamic(x, 0)
    graph = torch.compile(norm, options=OPTIONS, fullgraph=True)
    got, code = run_and_get_code(graph, x, weight)
    torch.testing.assert_close(got, norm(x, weight))
    return sum(source.count("#pragma omp parallel") for source in code)


def test_inductor_forks_threads_for_every_loop_with_dynamic_threads(monkeypatch):
    """What the worker works around: unpatched, one row's norm gets parallel regions."""
    from torch._inductor.codegen import cpp

    monkeypatch.setattr(compiled, "_SMALL_KERNELS_SERIAL", False)
    # The patch is process-wide once applied; restore inductor's own choice for this test.
    original = getattr(cpp.CppKernel.decide_parallel_depth, "__wrapped__", None)
    if original is not None:
        monkeypatch.setattr(cpp.CppKernel, "decide_parallel_depth", original)
    assert parallel_regions(1, 576) > 0


def test_small_fixed_loops_run_serially_and_batch_sized_ones_in_parallel():
    compiled._serial_small_kernels()
    assert parallel_regions(1, 576) == 0  # one row: under SERIAL_ELEMENTS
    assert parallel_regions(64, 4096) > 0  # a fixed loop of 262,144 elements
    assert parallel_regions(2, 576, dynamic=True) > 0  # its size follows the batch
