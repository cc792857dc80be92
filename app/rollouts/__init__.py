"""A rollout worker that runs an agent program: the endpoint it serves the agent, the episodes."""
