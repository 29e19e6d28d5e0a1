"""What the frontend, scheduler and worker processes share: the messages and their socket
plumbing, the sampling parameters and their checks, how tokens fill KV blocks, where the model's
files and nanoserve's cache live, and the model's tokenizer.

Nothing in this package imports torch: every process, the API front end included, can load it.
"""
