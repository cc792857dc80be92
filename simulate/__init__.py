"""Verifiable tasks, sandboxed execution, the multi-turn tool harness, rewards, group rollouts."""
