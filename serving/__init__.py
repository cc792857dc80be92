"""Inference engines (torch on CPU, vLLM on GPU), batching, hot-swap and the release subscriber."""
