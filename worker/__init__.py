"""The worker process: KV cache tensors, the model forward and sampling.

It knows nothing about requests beyond what one ``StepInput`` tells it (see ``worker.rows``).
``worker.worker.Worker`` imports torch; this package's top level does not.
"""

import os

# oneDNN caches one primitive per (layer shape, token count). Token counts vary every step
# (decode batch sizes, prefill chunks), so its default 1024 entries kept growing the worker's
# resident memory for many minutes (about 370 MiB in 1,656 steps); 16 entries hold the shapes
# in use and measured as fast. Read when oneDNN builds its first primitive, so it must be set
# before the first forward; a value the user exported wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")

from worker.config import WorkerConfig  # noqa: E402 - after the environment above

__all__ = ["WorkerConfig"]
