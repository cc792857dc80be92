"""Celery's wiring: `celery_app.py` (the app and its release and sandbox tasks, thin wrappers
over trainer/ and simulate/; `celery -A app.jobs.celery_app:celery_from_env worker`) and
`celery_fs.py` (the embedded profile's filesystem broker with atomic writes)."""
