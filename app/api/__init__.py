"""The HTTP API: `main.py` (the app factory and its lifespan), `routes/` (one router per
resource), `schemas.py` and `openai_schemas.py` (request and response models), `errors.py`
(one error shape), `deps.py`, `guard.py` (the outermost middleware), `services.py` (what a
running app holds) and the work behind the routes (completions, tool calls, feedback intake,
metrics, the console's figures, the replica table)."""
