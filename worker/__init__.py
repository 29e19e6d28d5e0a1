"""The worker process: KV cache tensors, the model forward and sampling.

It knows nothing about requests beyond what one ``StepInput`` tells it (see ``worker.rows``).
``worker.worker.Worker`` imports torch; this package's top level does not.
"""

import os

# oneDNN caches one primitive per matmul shape. The worker pads every step to bucketed sizes
# (worker.shapes), so a run meets a bounded set of shapes, and oneDNN's usual 1024 entries hold
# the ones in use: memory stops growing once they are built. (Unpadded, a new token count or
# context length almost every step grew the worker by about 370 MiB in 1,656 steps; a smaller
# cache only slowed that down.) Read when oneDNN builds its first primitive, so it is set here,
# before any forward; a value the user exported wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")

from worker.config import WorkerConfig  # noqa: E402 - after the environment above

__all__ = ["WorkerConfig"]
