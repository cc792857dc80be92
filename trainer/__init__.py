"""Policy logprobs, GRPO and online losses, training loops, lossless deltas, releases."""
