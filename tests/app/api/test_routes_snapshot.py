"""HTTP routes change on purpose: regenerate with `python -m tests.app.api.test_routes_snapshot`."""

from __future__ import annotations

import json
from pathlib import Path

from app.api.main import create_app
from app.settings import Settings

SNAPSHOT = Path(__file__).parents[2] / "snapshots" / "http_routes.json"


def current_routes() -> list[str]:
    """Method and path of every documented route (the OpenAPI surface clients see)."""
    app = create_app(Settings())  # building the app opens nothing: lifespan does
    paths = app.openapi()["paths"]
    return sorted(f"{method.upper()} {path}" for path, ops in paths.items() for method in ops)


def test_http_routes_snapshot() -> None:
    assert json.loads(SNAPSHOT.read_text()) == current_routes()


if __name__ == "__main__":
    SNAPSHOT.write_text(json.dumps(current_routes(), indent=1) + "\n")
    print(f"wrote {SNAPSHOT}")
