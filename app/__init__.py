"""Flywheel's edge: `api/` (the HTTP API: app factory, routes, request and response models,
errors, the services a running app holds), `cli/` (the `flywheel` command and the processes it
starts: the stack, the demo), `jobs/` (Celery: release and sandbox jobs), and what they share:
`settings.py` (one settings tree), `db.py` (the API's SQL tables), `heap.py`."""
