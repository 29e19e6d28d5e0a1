"""The KV pool holder: a small process that owns the shared CPU K/V pool (no model, no torch)."""
