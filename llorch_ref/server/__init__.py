"""The HTTP worker: /health, /execute (the llm-worker-rbee API, SSE) and OpenAI-compatible routes."""
