"""nanoserve: a small, sturdy LLM inference server (frontend, scheduler and worker processes)."""

__version__ = "0.1.0"
