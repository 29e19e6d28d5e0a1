"""The scheduler: block and slot ledgers, continuous batching with preemption and a watermark,
and the auditor that checks the ledgers between every iteration. Torch-free by design."""
