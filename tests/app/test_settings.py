"""Settings: profiles, bounds that name the field, and a snapshot of the public keys."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.settings import Settings

SNAPSHOT = Path(__file__).parents[1] / "snapshots" / "settings_keys.json"


def keys(schema: dict, defs: dict, prefix: str = "") -> list[str]:
    out = []
    for name, prop in schema.get("properties", {}).items():
        ref = prop.get("$ref") or next((a.get("$ref") for a in prop.get("anyOf", [])
                                        if "$ref" in a), None)
        if ref:
            out += keys(defs[ref.split("/")[-1]], defs, f"{prefix}{name}__")
        else:
            out.append(f"FLYWHEEL_{prefix}{name}".upper())
    return sorted(out)


def current_keys() -> list[str]:
    schema = Settings.model_json_schema()
    return keys(schema, schema.get("$defs", {}))


def test_embedded_is_the_default_and_needs_nothing(tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path)
    assert s.profile == "embedded"
    assert s.resolved_database_url.startswith("sqlite:///")
    assert s.kafka_config("127.0.0.1:1").session_timeout_ms == 6000


def test_production_requires_kafka_postgres_and_feedback_secrets() -> None:
    with pytest.raises(ValidationError, match="FLYWHEEL_KAFKA_BOOTSTRAP"):
        Settings(profile="production")
    with pytest.raises(ValidationError, match="FLYWHEEL_FEEDBACK_SECRETS"):
        Settings(profile="production", kafka_bootstrap="k:9092",
                 database_url="postgresql+psycopg://db/flywheel")
    s = Settings(profile="production", kafka_bootstrap="k:9092",
                 database_url="postgresql+psycopg://db/flywheel", feedback_secrets=["s"],
                 admin_token="an operator's own")
    assert s.kafka_config("k:9092").session_timeout_ms == 45000


@pytest.mark.parametrize("token", [None, "", "  ", "flywheel-admin"])
def test_production_refuses_no_admin_token_and_the_published_default(token: str | None
                                                                      ) -> None:
    with pytest.raises(ValidationError, match="FLYWHEEL_ADMIN_TOKEN"):
        Settings(profile="production", kafka_bootstrap="k:9092", admin_token=token,
                 database_url="postgresql+psycopg://db/flywheel", feedback_secrets=["s"])


def test_production_without_an_admin_token_exits_naming_it(tmp_path: Path) -> None:
    env = {**os.environ, "FLYWHEEL_PROFILE": "production", "FLYWHEEL_KAFKA_BOOTSTRAP": "k:9092",
           "FLYWHEEL_DATABASE_URL": "postgresql+psycopg://db/flywheel",
           "FLYWHEEL_FEEDBACK_SECRETS": '["s"]', "FLYWHEEL_ADMIN_TOKEN": "flywheel-admin"}
    out = subprocess.run([sys.executable, "-m", "app.cli", "up", "--data-dir", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "FLYWHEEL_ADMIN_TOKEN" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "admin_token").exists()


@pytest.mark.parametrize("host, keys, open_", [
    ("127.0.0.1", None, False), ("::1", None, False), ("localhost", None, False),
    ("0.0.0.0", None, True), ("10.1.2.3", None, True), ("flywheel.internal", None, True),
    ("0.0.0.0", True, False)])
def test_serving_beyond_this_machine_without_keys_is_flagged(host: str, keys: bool | None,
                                                             open_: bool) -> None:
    assert Settings(host=host, require_api_keys=keys).open_to_the_network is open_


def test_embedded_makes_one_admin_token_per_data_dir(tmp_path: Path) -> None:
    token = Settings(data_dir=tmp_path).admin_secret().get_secret_value()
    assert len(token) >= 32 and token != "flywheel-admin"
    kept = tmp_path / "admin_token"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600  # the owner's alone
    assert Settings(data_dir=tmp_path).admin_secret().get_secret_value() == token  # kept
    other = Settings(data_dir=tmp_path / "other").admin_secret().get_secret_value()
    assert other != token
    mine = Settings(data_dir=tmp_path, admin_token="mine").admin_secret()
    assert mine.get_secret_value() == "mine"
    assert "mine" not in repr(Settings(admin_token="mine"))  # a secret in no log line


def test_environment_is_read_with_the_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_KAFKA_BOOTSTRAP", "broker:9092")
    monkeypatch.setenv("FLYWHEEL_ENGINE__MAX_BATCH", "7")
    s = Settings()
    assert s.kafka_bootstrap == "broker:9092"
    assert s.engine.max_batch == 7


def test_bad_values_name_the_field() -> None:
    with pytest.raises(ValidationError, match="max_batch"):
        Settings(engine={"max_batch": 0})
    with pytest.raises(ValidationError, match="num_kv_heads"):
        Settings(model={"num_heads": 4, "num_kv_heads": 3})
    with pytest.raises(ValidationError, match="FLYWHEEL_ENGINE__PREFIX_CACHE_TOKENS"):
        Settings(batch_invariant=True, engine={"prefix_cache_tokens": 4096})


def test_settings_keys_snapshot() -> None:
    """Public configuration changes on purpose: `python -m tests.app.test_settings`."""
    assert json.loads(SNAPSHOT.read_text()) == current_keys()


if __name__ == "__main__":
    SNAPSHOT.write_text(json.dumps(current_keys(), indent=1) + "\n")
    print(f"wrote {SNAPSHOT}")


def test_relative_paths_become_absolute_where_the_settings_are_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative directory means this process's working directory: made absolute once, so
    a child process or a comparison with a resolved path reads the same place."""
    monkeypatch.chdir(tmp_path)
    s = Settings(model_dir="m", artifact_store_url="file://store",
                 bootstrap={"run_dir": "runs/r", "policy_store_url": "policy"},
                 online={"checkpoint_dir": "ckpt"}, release={"candidate_path": "c"})
    cwd = tmp_path.resolve()
    assert s.data_dir == cwd / "data" and s.model_dir == cwd / "m"
    assert s.artifact_store_url == str(cwd / "store")
    assert s.bootstrap.run_dir == cwd / "runs" / "r"
    assert s.bootstrap.policy_store_url == str(cwd / "policy")
    assert s.online.checkpoint_dir == cwd / "ckpt"
    assert s.release.candidate_path == cwd / "c"
    assert s.resolved_database_url == f"sqlite:///{cwd / 'data' / 'flywheel.db'}"
    remote = Settings(artifact_store_url="s3://bucket/flywheel")
    assert remote.artifact_store_url == "s3://bucket/flywheel"
