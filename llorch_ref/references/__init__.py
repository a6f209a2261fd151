"""Independent references the reference is checked against (llama.cpp; transformers later)."""
