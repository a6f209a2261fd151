"""Adapters at the edge: every source becomes the same (Config, Weights, tokenizer metadata)."""
