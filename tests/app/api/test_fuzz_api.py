"""Schemathesis against a real `flywheel up`: every operation of `/openapi.json`, fed valid and
invalid inputs generated from the document itself, must answer without a 5xx and as the
document says (status, content type, body schema). The admin token is sent so the admin
routes are fuzzed past their 401; feedback runs unsigned (no secrets) so it is fuzzed past
the signature check (tests/ingest/test_signing.py fuzzes the header parser itself)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from app.api.main import create_app
from app.settings import Settings
from tests.conftest import flywheel_up

pytestmark = pytest.mark.integration
TOKEN = "fuzz-admin-token"
_PATHS = create_app(Settings()).openapi()["paths"]  # building the app opens nothing


def _can_be_violated(op: dict) -> bool:
    """A body, credentials, or a parameter narrower than any string."""
    return bool(op.get("requestBody") or op.get("security") or any(
        p["schema"] != {"type": "string", "title": p["schema"].get("title")}
        for p in op.get("parameters", [])))


# every documented operation with inputs the document allows and, where an input can break
# it, inputs it forbids (which must be refused with a documented 4xx)
CASES = sorted((path, method.upper(), mode) for path, ops in _PATHS.items()
               for method, op in ops.items() for mode in schemathesis.GenerationMode
               if mode == "positive" or _can_be_violated(op))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[str]:
    with flywheel_up(tmp_path_factory.mktemp("fuzz"), model_dir, FLYWHEEL_ADMIN_TOKEN=TOKEN,
                     FLYWHEEL_FEEDBACK_SECRETS="[]", FLYWHEEL_ENGINE__MAX_NEW_TOKENS_CAP="8",
                     FLYWHEEL_ENGINE__DEFAULT_MAX_TOKENS="4") as (url, _):
        yield url


@pytest.fixture(scope="module")
def api_schema(server: str) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{server}/openapi.json")


@pytest.mark.parametrize("path, method, mode", CASES)
def test_every_operation_keeps_its_contract(api_schema: schemathesis.BaseSchema, server: str,
                                            path: str, method: str,
                                            mode: schemathesis.GenerationMode) -> None:
    """No 5xx, and every answer as documented. Not checked: that every schema-valid input is
    accepted (`positive_data_acceptance`): limits set by configuration (max_tokens cap,
    context length, candidate paths) refuse some with the documented 400."""
    operation = api_schema[path][method]

    @settings(max_examples=50, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def keeps_contract(case: schemathesis.Case) -> None:
        dropped = mode == "negative" and "Authorization" not in (case.headers or {})
        headers = {} if dropped else {"Authorization": f"Bearer {TOKEN}"}  # else: the token
        case.call_and_validate(base_url=server, timeout=30, headers=headers,
                               excluded_checks=[positive_data_acceptance])

    keeps_contract()
