"""The worker process: KV cache tensors, the model forward and sampling.

It knows nothing about requests beyond what one ``StepInput`` tells it (see ``worker.rows``).
``worker.worker.Worker`` imports torch; this package's top level does not.
"""

import os

from worker.config import WorkerConfig

# torch's CPU allocator puts tensors of 2 MiB and more on transparent huge pages when this is set
# (it reads it once, at its first allocation, so before anything imports torch). A decode step
# streams the KV pool and the packed weights from memory; with 4 KiB pages a batch-32 step took
# 27.7 and 25.1 ms, with 2 MiB pages 24.5 and 23.9 (context 200, compiled, processes alternating;
# a 32 x 128 prefill: no change). A user's own value wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__all__ = ["WorkerConfig"]
