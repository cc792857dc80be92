"""Flywheel HTTP edge: FastAPI app, routes, settings, CLI, Celery app and SQL models."""
