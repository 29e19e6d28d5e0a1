"""Settings for the whole suite.

Tests compare texts across runs, batchings and pool sizes, and against transformers: float32
makes those comparisons exact, while a bfloat16 text may change with the shape of the step it
ran in. So every process a test starts, and every worker it builds, runs float32 unless the test
names another dtype (the served default, ``auto``, is bfloat16 on CPUs that compute it).

Compiling the real model takes minutes of CPU, so served workers do not compile unless a test
asks (the default compiles in the background where it pays).
"""

from __future__ import annotations

import os

import torch

os.environ.setdefault("NANOSERVE_DTYPE", "float32")
os.environ.setdefault("NANOSERVE_COMPILE", "0")
# Without a GPU, Triton's kernels run in its interpreter (tests/worker/test_triton_attention.py).
# Triton reads the variable when it is first imported, and other modules of the session may
# import it (torch's inductor does), so it is set here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
