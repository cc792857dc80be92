"""One typed settings tree for every Flywheel process.

Built once at the edge (CLI or app factory) from `FLYWHEEL_*` environment variables and passed
down explicitly; no other module reads the environment. Two profiles:

- `embedded` (default): everything on one machine with zero set-up: a Tansu broker started as a
  subprocess, SQLite under the data dir, Celery on a filesystem broker, a local artifact dir.
- `production`: an existing Kafka cluster and PostgreSQL are required; Kafka consumer timeouts
  keep Kafka's usual values.

Nested groups use `__` in the environment (`FLYWHEEL_ENGINE__MAX_BATCH=32`); the connection
settings are flat so `FLYWHEEL_KAFKA_BOOTSTRAP` and `FLYWHEEL_DATABASE_URL` read naturally.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ingest.config import JoinSettings, KafkaClientSettings, KafkaConfig, TopicSettings
from serving.config import EngineSettings
from simulate.scavenge import ScavengeSettings
from trainer.bootstrap.config import BootstrapSettings
from trainer.config import TinyModelSettings
from trainer.online.config import OnlineTrainerSettings
from trainer.release.config import ReleaseConfig, ReleaseSettings
from trainer.trackers import TrackerSettings

Profile = Literal["embedded", "production"]
ADMIN_TOKEN_FILE = "admin_token"
# Flywheel's admin token defaulted to this constant once: anyone who read the docs knows it
PUBLISHED_ADMIN_TOKENS = frozenset({"flywheel-admin"})


def absolute(path: Path) -> Path:
    """`path` against this process's working directory, `~` and symbolic links resolved."""
    return path.expanduser().resolve()


def absolute_store_url(url: str) -> str:
    """A local artifact store (a plain path or a file:// URL) as an absolute path; any other
    URL as it is."""
    if "://" in url and not url.startswith("file://"):
        return url
    return str(absolute(Path(url.removeprefix("file://"))))


def local_admin_token(data_dir: Path) -> SecretStr:
    """The admin token kept in `<data_dir>/admin_token` (owner-only), a random one written
    there by whichever process asks first: every process on that data dir (the API, the
    trainer's control, the CLI, the demo) agrees on it without a setting."""
    path = data_dir / ADMIN_TOKEN_FILE
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=data_dir, prefix=f".{ADMIN_TOKEN_FILE}.")  # mode 0600
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(32) + "\n")
        try:  # atomic and never over another process's token: link fails if it exists
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    return SecretStr(path.read_text().strip())


class Settings(BaseSettings):
    """Everything a Flywheel process needs to know, validated at start-up."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_", env_nested_delimiter="__",
                                      extra="ignore")

    profile: Profile = "embedded"
    data_dir: Path = Path("data")
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)

    kafka_bootstrap: str | None = None
    database_url: str | None = None
    celery_broker_url: str | None = None
    artifact_store_url: str | None = None
    model_dir: Path | None = None

    # The admin API's bearer token. Required in production; unset in the embedded profile, a
    # random one is made for the data dir and kept in <data_dir>/admin_token (`admin_secret`)
    admin_token: SecretStr | None = None
    # Inference keys (app/api/api_keys.py) on /v1: None means required in production, off in
    # the embedded profile (any caller; the Authorization header is not read)
    require_api_keys: bool | None = None
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    # Feedback webhook (ingest/signing.py): HMAC secrets, several while rotating, JSON list in
    # FLYWHEEL_FEEDBACK_SECRETS. Required in production; empty in the embedded profile accepts
    # unsigned webhooks (local use; warned at start).
    feedback_secrets: list[SecretStr] = Field(default_factory=list)
    feedback_tolerance_s: int = Field(default=300, ge=1, le=86_400)
    feedback_batch_max: int = Field(default=1000, ge=1, le=10_000)

    topics: TopicSettings = TopicSettings()
    kafka: KafkaClientSettings = KafkaClientSettings()
    engine: EngineSettings = EngineSettings()
    # One switch for numerics (kernels/batch_invariant.py): the serving engine and every
    # trainer run the batch-invariant ops, so their logprobs agree bit for bit (vLLM: its own
    # VLLM_BATCH_INVARIANT=1 mode). Costs ~1.4x decode time on CPU (bench/numerics.py).
    batch_invariant: bool = False
    model: TinyModelSettings = TinyModelSettings()
    bootstrap: BootstrapSettings = BootstrapSettings()
    release: ReleaseSettings = ReleaseSettings()
    join: JoinSettings = JoinSettings()
    online: OnlineTrainerSettings = OnlineTrainerSettings()
    trackers: TrackerSettings = TrackerSettings()  # TensorBoard, MLflow (trainer/trackers.py)
    scavenge: ScavengeSettings = ScavengeSettings()  # off-peak rollouts (simulate/scavenge.py)

    @model_validator(mode="after")
    def _production_needs_services(self) -> Settings:
        if self.profile == "production":
            missing = [name for name in ("kafka_bootstrap", "database_url")
                       if getattr(self, name) is None]
            if missing:
                fields = ", ".join(f"FLYWHEEL_{m.upper()}" for m in missing)
                raise ValueError(f"profile 'production' requires {fields}")
            if not self.feedback_secrets:  # never accept unsigned feedback in production
                raise ValueError("profile 'production' requires FLYWHEEL_FEEDBACK_SECRETS "
                                 "(feedback_secrets): a JSON list of webhook HMAC secrets")
            if self.require_api_keys is False:
                raise ValueError("profile 'production' requires inference keys: unset "
                                 "FLYWHEEL_REQUIRE_API_KEYS")
            token = self.admin_token.get_secret_value().strip() if self.admin_token else ""
            if not token or token in PUBLISHED_ADMIN_TOKENS:
                raise ValueError("profile 'production' requires FLYWHEEL_ADMIN_TOKEN "
                                 "(admin_token): a secret of your own, not empty and not the "
                                 "default earlier versions of Flywheel published")
        return self

    @model_validator(mode="after")
    def _absolute_paths(self) -> Settings:
        """Every directory and local store root, made absolute here, once: a relative path
        means the working directory this process started in, and the processes and threads
        given these settings (rollout workers, the sandbox, the release pipeline) must not
        read it against another one or compare it with a resolved one."""
        self.data_dir = absolute(self.data_dir)
        self.model_dir = self.model_dir and absolute(self.model_dir)
        self.artifact_store_url = self.artifact_store_url and absolute_store_url(
            self.artifact_store_url)
        self.bootstrap = self.bootstrap.model_copy(update={
            "run_dir": self.bootstrap.run_dir and absolute(self.bootstrap.run_dir),
            "policy_store_url": self.bootstrap.policy_store_url and absolute_store_url(
                self.bootstrap.policy_store_url)})
        self.online = self.online.model_copy(update={
            "checkpoint_dir": self.online.checkpoint_dir and absolute(self.online.checkpoint_dir)})
        self.release = self.release.model_copy(update={
            "candidate_path": self.release.candidate_path and absolute(
                self.release.candidate_path)})
        return self

    @model_validator(mode="after")
    def _prefix_cache_is_not_bitwise(self) -> Settings:
        if self.batch_invariant and self.engine.prefix_cache_tokens:
            raise ValueError("FLYWHEEL_ENGINE__PREFIX_CACHE_TOKENS must be 0 with "
                             "FLYWHEEL_BATCH_INVARIANT: a cached prefix's keys/values come "
                             "from other forward passes, so logprobs are not bitwise equal")
        return self

    @property
    def api_keys_required(self) -> bool:
        """Whether /v1 takes only callers holding an inference key."""
        if self.require_api_keys is None:
            return self.profile == "production"
        return self.require_api_keys

    @property
    def open_to_the_network(self) -> bool:
        """Serving /v1 without keys on an address other machines can reach (warned at start:
        anyone who reaches it generates, and what they type is logged and trained on)."""
        if self.api_keys_required or self.host == "localhost":
            return False
        try:
            return not ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name: assume it resolves beyond this machine
            return True

    @property
    def admin_token_is_local(self) -> bool:
        """No admin token set (or a blank one): the data dir keeps its own."""
        return self.admin_token is None or not self.admin_token.get_secret_value().strip()

    def admin_secret(self) -> SecretStr:
        """The admin API's token: `admin_token`, or where none is set (the embedded profile)
        the data dir's own, made on first use (`local_admin_token`)."""
        if self.admin_token is not None and not self.admin_token_is_local:
            return self.admin_token
        return local_admin_token(self.data_dir)

    # Derived locations and values: one place, so no caller re-derives them differently.
    @property
    def resolved_model_dir(self) -> Path:
        return self.model_dir if self.model_dir is not None else self.data_dir / "models" / "base"

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'flywheel.db'}"

    @property
    def resolved_join_database_url(self) -> str:
        return self.join.database_url or f"sqlite:///{self.data_dir / 'join.db'}"

    @property
    def resolved_celery_broker_url(self) -> str:
        return self.celery_broker_url or "filesystem://"

    @property
    def resolved_candidate_path(self) -> Path:
        return self.release.candidate_path or self.data_dir / "checkpoints" / "latest"

    @property
    def resolved_artifact_store_url(self) -> str:
        return self.artifact_store_url or str(self.data_dir / "artifacts")

    def kafka_config(self, bootstrap: str) -> KafkaConfig:
        """Resolve client settings for `bootstrap` (the embedded broker's or the cluster's)."""
        # Tansu holds a group join for ~half the session timeout, so the embedded profile uses
        # 6 s; a real cluster keeps Kafka's usual 45 s.
        session = self.kafka.session_timeout_ms or (6_000 if self.profile == "embedded"
                                                    else 45_000)
        heartbeat = self.kafka.heartbeat_interval_ms or max(100, session // 3)
        return KafkaConfig(bootstrap=bootstrap, topics=self.topics, session_timeout_ms=session,
                           heartbeat_interval_ms=heartbeat,
                           request_timeout_ms=self.kafka.request_timeout_ms,
                           delivery_timeout_ms=self.kafka.delivery_timeout_ms,
                           linger_ms=self.kafka.linger_ms)

    def release_config(self) -> ReleaseConfig:
        """What the release pipeline (trainer/release/pipeline.py) needs; it announces on Kafka."""
        if self.kafka_bootstrap is None:
            raise RuntimeError("settings.kafka_bootstrap is unset: releases need Kafka")
        return ReleaseConfig(release=self.release, model_dir=self.resolved_model_dir,
                             candidate_path=self.resolved_candidate_path,
                             cache_dir=self.data_dir / "releases",
                             store_url=self.resolved_artifact_store_url,
                             database_url=self.resolved_database_url,
                             kafka=self.kafka_config(self.kafka_bootstrap),
                             tasks=self.bootstrap.tasks,
                             harness=self.bootstrap.harness(temperature=0.0))
