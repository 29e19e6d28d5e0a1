"""The worker process: KV cache tensors, the model forward and sampling.

It knows nothing about requests beyond what one ``StepInput`` tells it (see ``worker.rows``).
``worker.worker.Worker`` imports torch; this package's top level does not.
"""

from worker.config import WorkerConfig

__all__ = ["WorkerConfig"]
