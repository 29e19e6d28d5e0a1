"""Sampling: the host sampler, the device sampler a step runs on the GPU, their packed inputs,
and the repetition, frequency and presence penalties."""
