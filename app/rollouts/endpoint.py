"""The endpoint a rollout worker serves its agent program: `flywheel up`'s OpenAI routes on
the worker's engine, each generation logged to its episode, the verdict taken as a webhook is.

The routes are the app's own (`app.api.routes.completions`, `models`): the same templates,
tool-call parsing, streaming and `GenerationLogged` records as a serving replica, so what an
agent does against `flywheel up` it does here. What differs:

- inference keys are required, one per episode (`open`), whose user id is the episode's session:
  a generation is the episode's by the key that asked for it, whatever its body says; an
  episode past its request budget is refused (429) and dropped as a flood. The keys live in
  the `EpisodeBook`, as long as their episode, not in a table: the book is the app's key check
  here (a key made and revoked in SQL per episode cost the worker's event loop about 40 ms an
  episode, SQLite's lock shared with the requests' key checks);
- the session log is the `EpisodeBook`: each record goes to its episode, in memory;
- `POST /v1/feedback` takes the episode's verdict: the webhook's body (`FeedbackRequest`) about
  a session, signed (`ingest.signing`) with the episode's feedback secret. A body no open
  episode signed is 401; one signed by an episode about another session is 403 and drops the
  signer's episode (a forged verdict); feedback on one generation is 422 (an episode ends with
  a verdict on its session).

    with RolloutEndpoint.serve(engine, producer, kafka, workdir) as endpoint:
        episode = endpoint.open(session_id, temperature=1.0, max_requests=64)
        ...  # the agent runs against endpoint.base_url with episode.key
        endpoint.close(episode)
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request, Response, status
from pydantic import ValidationError
from sqlalchemy import create_engine

from app.api.api_keys import PREFIX, ApiKeyError, Caller, bearer_key, new_key
from app.api.deps import CallerDep
from app.api.errors import ApiError, install_error_handlers
from app.api.guard import RequestGuard
from app.api.routes import completions, models
from app.api.schemas import FeedbackAccepted, FeedbackRequest
from app.api.services import Services
from app.settings import Settings
from ingest.config import KafkaConfig
from ingest.events import FeedbackReceived, GenerationLogged
from ingest.log import EventProducer
from ingest.signing import SIGNATURE_HEADER, SignatureError, verify
from serving.engine import Engine
from simulate.agents import DropReason

log = logging.getLogger(__name__)

VERDICT_TOLERANCE_S = 300  # a verdict's signature timestamp may be this far from now


@dataclass
class Episode:
    """One agent episode as the endpoint sees it: its key and secret, what it generated."""

    session_id: str
    key_id: str
    key_secret: str  # the secret part of its inference key
    secret: str  # signs its verdict
    temperature: float  # the job's: a generation sampled at another cannot train
    max_requests: int
    records: list[GenerationLogged] = field(default_factory=list)
    requests: int = 0
    verdict: FeedbackReceived | None = None
    dropped: DropReason | None = None

    @property
    def key(self) -> str:
        """The whole inference key, given to the agent."""
        return f"{PREFIX}{self.key_id}.{self.key_secret}"

    def drop(self, reason: DropReason) -> None:
        """Mark the episode dropped (the first reason stands)."""
        if self.dropped is None:
            self.dropped = reason
            log.warning("episode %s dropped: %s", self.session_id, reason)


class EpisodeBook:
    """The open episodes, by session and by key: the app's key check (`check`) knows a request
    by its episode's key, and the app's session log (`submit`) files each generation under the
    episode whose key made it."""

    def __init__(self) -> None:
        self._episodes: dict[str, Episode] = {}
        self._by_key: dict[str, Episode] = {}
        self._lock = threading.Lock()

    def add(self, episode: Episode) -> None:
        with self._lock:
            self._episodes[episode.session_id] = episode
            self._by_key[episode.key_id] = episode

    def remove(self, episode: Episode) -> None:
        with self._lock:
            self._episodes.pop(episode.session_id, None)
            self._by_key.pop(episode.key_id, None)

    def check(self, authorization: str | None) -> Caller:
        """The key check (`app.api.api_keys.KeyChecker`): an open episode's key speaks for
        its session; any other key, a closed episode's among them, is 401."""
        parsed = bearer_key(authorization)
        with self._lock:
            episode = self._by_key.get(parsed[0]) if parsed else None
        if parsed is None or episode is None or not hmac.compare_digest(
                episode.key_secret, parsed[1]):
            raise ApiKeyError(401, "the inference key is not an open episode's")
        return Caller(key_id=episode.key_id, user_id=episode.session_id)

    def get(self, session_id: str | None) -> Episode | None:
        with self._lock:
            return self._episodes.get(session_id) if session_id is not None else None

    def admit(self, session_id: str) -> None:
        """Count one model request of the episode; 429 past its budget (the episode is then
        dropped as a flood) or once it was dropped."""
        episode = self.get(session_id)
        if episode is None:  # closed since its key was checked
            raise ApiError(status.HTTP_401_UNAUTHORIZED, "this episode has ended",
                           code="invalid_api_key")
        with self._lock:
            episode.requests += 1
            over = episode.requests > episode.max_requests
        if over:
            episode.drop("flood")
        if episode.dropped is not None:
            raise ApiError(status.HTTP_429_TOO_MANY_REQUESTS,
                           f"this episode made more than {episode.max_requests} model requests"
                           if over else f"this episode was dropped ({episode.dropped})",
                           code="rate_limit_exceeded")

    def submit(self, event: GenerationLogged) -> None:
        """The session log's `submit`: the record to its episode (the key's user id is the
        episode's session), under that session; a generation the client abandoned
        (cancelled) was never part of the episode, and nothing of a closed episode trains."""
        episode = self.get(event.user_id)
        if episode is None or event.finish_reason == "cancelled":
            return
        if event.sampling.temperature != episode.temperature:
            episode.drop("temperature")
        with self._lock:
            episode.records.append(event.model_copy(update={"session_id": episode.session_id}))

    def take_verdict(self, header: str | None, body: bytes) -> FeedbackReceived:
        """Check and keep a verdict (see the module's docstring for the refusals)."""
        with self._lock:
            episodes = list(self._episodes.values())
        signer = None
        for episode in episodes:
            try:
                verify(header, body, [episode.secret], tolerance_s=VERDICT_TOLERANCE_S)
            except SignatureError:
                continue
            signer = episode
            break
        if signer is None:
            raise ApiError(status.HTTP_401_UNAUTHORIZED, "the verdict is not signed by an open "
                           f"episode's feedback secret ({SIGNATURE_HEADER})",
                           code="invalid_signature")
        try:
            event = FeedbackRequest.model_validate_json(body)
        except ValidationError as exc:
            raise ApiError(status.HTTP_422_UNPROCESSABLE_CONTENT,
                           f"not a feedback event: {exc.errors()[0]['msg']}") from exc
        if event.session_id is None:
            raise ApiError(status.HTTP_422_UNPROCESSABLE_CONTENT, "an episode ends with a verdict"
                           " on its session: send session_id, not generation_id",
                           param="session_id")
        if event.session_id != signer.session_id:
            signer.drop("forged_verdict")
            raise ApiError(status.HTTP_403_FORBIDDEN, f"session {event.session_id} is not this "
                           f"episode's ({signer.session_id})", param="session_id",
                           code="forged_verdict")
        signer.verdict = event.event()
        return signer.verdict

    def close(self) -> None:
        """The session log's `close`: nothing is buffered."""


async def admit_episode(request: Request, caller: CallerDep) -> None:
    """The model routes' dependency: the caller's episode may make one more request."""
    assert caller is not None  # keys are required on this endpoint
    request.app.state.book.admit(caller.user_id)


verdicts = APIRouter(tags=["rollouts"])


@verdicts.post("/v1/feedback", status_code=status.HTTP_202_ACCEPTED,
               response_model=FeedbackAccepted)
async def post_verdict(request: Request) -> Response:
    """The episode's verdict on its session (the webhook's contract)."""
    book: EpisodeBook = request.app.state.book
    event = book.take_verdict(request.headers.get(SIGNATURE_HEADER), await request.body())
    return Response(FeedbackAccepted(event_id=event.event_id, duplicate=False).model_dump_json(),
                    status.HTTP_202_ACCEPTED, media_type="application/json")


class RolloutEndpoint:
    """The app's model routes and the verdict route on `engine`, on a loopback port."""

    def __init__(self, services: Services, book: EpisodeBook) -> None:
        self.services, self.book = services, book
        self.app = FastAPI(title="Flywheel rollouts")
        self.app.state.services, self.app.state.book = services, book
        self.app.include_router(completions.router, dependencies=[Depends(admit_episode)])
        self.app.include_router(models.router)
        self.app.include_router(verdicts)
        install_error_handlers(self.app)
        self.app.add_middleware(RequestGuard, max_body_bytes=services.settings.max_body_bytes)
        self.base_url = ""

    @classmethod
    @contextmanager
    def serve(cls, engine: Engine, producer: EventProducer, kafka: KafkaConfig,
              workdir: Path) -> Iterator[RolloutEndpoint]:
        """Serve on 127.0.0.1 (an ephemeral port) until the block ends."""
        import uvicorn

        settings = Settings(profile="embedded", require_api_keys=True, data_dir=workdir)
        # `Services` holds a database; nothing this endpoint serves reads one (the keys are
        # the book's), so it gets an empty one in memory, not a file with the API's tables
        db = create_engine("sqlite://")
        book = EpisodeBook()
        services = Services(settings=settings, kafka=kafka, engine=engine, producer=producer,
                            db=db, tokenizer=engine.tokenizer, session_log=book, keys=book)
        endpoint = cls(services, book)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        endpoint.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        server = uvicorn.Server(uvicorn.Config(endpoint.app, log_level="warning",
                                               lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                  name="rollout-endpoint", daemon=True)
        thread.start()
        try:
            yield endpoint
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            sock.close()
            db.dispose()

    def open(self, session_id: str, *, temperature: float, max_requests: int) -> Episode:
        """A new episode: its key (the user id is the session) and verdict secret."""
        key_id, key_secret, _ = new_key()
        episode = Episode(session_id=session_id, key_id=key_id, key_secret=key_secret,
                          secret=secrets.token_urlsafe(24), temperature=temperature,
                          max_requests=max_requests)
        self.book.add(episode)
        return episode

    def close(self, episode: Episode) -> None:
        """End the episode: its key stops working, later requests and records go nowhere."""
        self.book.remove(episode)
