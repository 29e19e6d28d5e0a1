"""One step on the device: its inputs packed into one copy, launched, captured as a CUDA graph
where it can be, and resolved when its sampled ids are back (two steps may be in flight)."""
