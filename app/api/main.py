"""The FastAPI app factory. `lifespan` creates the engine, the producer and the DB.

`settings.kafka_bootstrap` must name a reachable broker by the time the app starts (the CLI
starts the embedded one first). Tests may pass ready-made `Services` instead.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from app.api.errors import error_responses, install_error_handlers
from app.api.guard import RequestGuard
from app.api.metrics import Metrics
from app.api.replicas import ReplicaBeacon, replica_id
from app.api.routes import admin, completions, console, deletions, feedback, health, keys, models
from app.api.routes import metrics as metrics_route
from app.api.routes import releases as releases_route
from app.api.routes import trainer as trainer_route
from app.api.services import Services
from app.heap import settle_heap
from app.settings import Settings
from serving.engine import Engine

log = logging.getLogger(__name__)


def build_services(settings: Settings) -> Services:
    """Open everything a serving process holds; the caller closes it with `close_services`."""
    from sqlmodel import Session

    from app.db import ServedVersion, make_db_engine
    from ingest.log import EventProducer, ensure_topics
    from ingest.session_log import SessionLog
    from ingest.spool import Spool
    from serving.backends import build_engine
    from serving.config import on_own_thread
    from trainer.init_model import init_model

    if settings.kafka_bootstrap is None:
        raise RuntimeError("settings.kafka_bootstrap is unset: start a broker first")
    kafka = settings.kafka_config(settings.kafka_bootstrap)
    ensure_topics(kafka)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = make_db_engine(settings.resolved_database_url)
    model_dir = settings.resolved_model_dir
    if settings.model_dir is None:  # the default model is built on first use, on a thread
        # that ends, as the engine loads (serving.config.on_own_thread says why)
        on_own_thread(lambda: init_model(settings.model, model_dir))
    engine = build_engine(settings.engine, model_dir, batch_invariant=settings.batch_invariant)
    with Session(db) as session:
        if session.get(ServedVersion, engine.version.number) is None:
            session.add(ServedVersion(number=engine.version.number, sha256=engine.version.sha256))
            session.commit()
    producer = EventProducer(kafka, client_id="flywheel-api")
    session_log = SessionLog(kafka, Spool(settings.data_dir / "spool" / "sessions.jsonl")).start()
    metrics = Metrics()
    if not settings.feedback_secrets:
        log.warning("FLYWHEEL_FEEDBACK_SECRETS is empty: feedback webhooks are not verified")
    if settings.open_to_the_network:
        log.warning("WARNING: /v1 is served on %s without inference keys: anyone who reaches "
                    "it generates, and what they send is logged and trained on. Set "
                    "FLYWHEEL_REQUIRE_API_KEYS=true (flywheel keys create --user U)",
                    settings.host)
    services = Services(settings=settings, kafka=kafka, engine=engine, producer=producer,
                        db=db, tokenizer=engine.tokenizer, session_log=session_log,
                        metrics=metrics, admin=settings.admin_secret())
    metrics.bind(engine=engine, session_log=session_log, trainer_db=db,
                 join_lag=lambda: services.console_feeds().join_lag(wait=False))
    services.beacon = ReplicaBeacon(db, replica_id(settings.port),
                                    lambda: services.engine.version).start()
    return services


def start_release_follower(services: Services) -> None:
    """Hot-swap every release announced on `releases`, and serve a canary on a second engine
    where `release.canary.serve` allows it (serving/release_subscriber.py)."""
    from serving.backends import build_engine
    from serving.release_subscriber import follow_releases

    settings = services.settings

    def canary_engine() -> Engine:
        return build_engine(settings.engine, settings.resolved_model_dir,
                            batch_invariant=settings.batch_invariant)

    services.replica = follow_releases(
        services.versions, services.kafka, settings.resolved_artifact_store_url,
        poll_timeout_ms=settings.release.poll_timeout_ms, registry=services.metrics.registry,
        canary_engine=canary_engine if settings.release.canary.serve else None)


def start_scavenger(services: Services) -> None:
    """Off-peak rollouts for the bootstrap on this replica's cores (simulate/scavenge.py)."""
    from simulate.rollout_worker import WorkerLaunch, host_worker_id
    from simulate.scavenge import Scavenger

    settings, scavenge = services.settings, services.settings.scavenge
    if scavenge.store_url is None:
        raise RuntimeError("FLYWHEEL_SCAVENGE__STORE_URL: the bootstrap's policy store")
    options = settings.bootstrap.worker_options(
        f"{host_worker_id()}-scavenger",
        batch_invariant=settings.batch_invariant).model_copy(
        update={"groups_in_flight": scavenge.groups_in_flight})
    kafka = (settings.kafka_config(scavenge.kafka_bootstrap) if scavenge.kafka_bootstrap
             else services.kafka)
    services.scavenger = Scavenger(services.live, WorkerLaunch(
        kafka=kafka, store_url=scavenge.store_url, options=options), scavenge).start()


def close_services(services: Services) -> None:
    if services.canary_watch is not None:
        services.canary_watch.close()
    if services.scavenger is not None:
        services.scavenger.stop()
    if services.beacon is not None:
        services.beacon.close()
    if services.replica is not None:
        services.replica.stop()
    if services.session_log is not None:  # before the engine: in-flight choices log on exit
        services.session_log.close()
    if services.feedback is not None:
        services.feedback.close()
    if services.console is not None:
        services.console.close()
    services.producer.flush(timeout_s=services.kafka.delivery_timeout_ms / 1000)
    services.producer.close()
    services.engine.close()
    services.db.dispose()
    if services.join_db is not None:
        services.join_db.dispose()


def create_app(settings: Settings, *, services: Services | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = services is None
        app.state.services = build_services(settings) if owned else services
        if owned and settings.release.follow:
            start_release_follower(app.state.services)
        if owned and settings.scavenge.enabled:
            start_scavenger(app.state.services)
        canary = settings.release.canary
        if owned and canary.enabled and canary.decide:
            from trainer.release.canary_watch import CanaryWatch

            app.state.services.canary_watch = CanaryWatch(settings.release_config()).start()
        worker = None
        if owned:  # the embedded profile runs its own release worker (app/jobs/celery_app.py)
            from app.jobs.celery_app import start_release_worker

            worker = start_release_worker(settings, app.state.services.release_tasks())
        if owned:
            settle_heap()
        try:
            yield
        finally:
            if worker is not None:
                worker.stop()
            if owned:
                close_services(app.state.services)

    app = FastAPI(title="Flywheel", version="0.1.0", lifespan=lifespan)
    for module in (completions, feedback, models, admin, keys, deletions, releases_route,
                   trainer_route, health, metrics_route, console):
        app.include_router(module.router)
    install_error_handlers(app)

    def count_oversized(path: str) -> None:  # a webhook refused before any route saw it
        if path.startswith("/v1/feedback"):
            app.state.services.metrics.feedback_rejected.labels("request_too_large").inc()

    app.add_middleware(RequestGuard, max_body_bytes=settings.max_body_bytes,  # outermost
                       on_oversized=count_oversized)
    app.openapi = functools.partial(openapi_document, app)  # type: ignore[method-assign]
    return app


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with:
    - the answers any route may give: 500 (app/api/guard.py) on every one; on every one that
      takes a body, 413 (app/api/guard.py) and 400 (a body that is not UTF-8 text, which FastAPI
      refuses before validation);
    - less the 422 `HTTPValidationError` answer FastAPI adds to every route with parameters:
      no route answers that shape (app/api/errors.py); each documents its own validation status
      (400 on the inference routes, 422 elsewhere) with the error body."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        guard = error_responses(400, 413, 500)
        for operations in document["paths"].values():
            for operation in operations.values():
                answers = operation["responses"]
                if "HTTPValidationError" in json.dumps(answers.get("422", {})):
                    del answers["422"]
                for status in (400, 413, 500) if "requestBody" in operation else (500,):
                    answers.setdefault(str(status), {
                        "description": guard[status]["description"], "content": {
                            "application/json": {"schema": {
                                "$ref": "#/components/schemas/ErrorResponse"}}}})
        for name in ("HTTPValidationError", "ValidationError"):
            document.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = document
    return app.openapi_schema
