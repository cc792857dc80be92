"""The official `openai` client, unmodified, against the running stack: sync and streaming,
chat and completions; every choice it received is a logged generation."""

from __future__ import annotations

import pytest

from app.cli.stack import running_stack
from app.settings import Settings
from tests.app.api.helpers import check_openai_client

pytestmark = pytest.mark.integration


def test_openai_client_chat_and_completions(settings: Settings) -> None:
    with running_stack(settings) as stack:
        check_openai_client(stack.base_url, stack.kafka)


