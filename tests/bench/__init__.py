"""Tests of ``nanoserve bench serve`` against a scripted OpenAI-compatible stub server."""
