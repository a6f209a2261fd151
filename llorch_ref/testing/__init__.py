"""Helpers for tests and tools: tiny deterministic random models written as real GGUF files."""
