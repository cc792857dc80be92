"""`GET /v1/models`: the one model this server serves, named as requests may name it."""

from __future__ import annotations

import time

from fastapi import APIRouter

from app.api.completion_plan import SERVED_MODEL
from app.api.deps import CallerDep, ServicesDep
from app.api.errors import ApiError, error_responses
from app.api.openai_schemas import ModelCard, ModelList
from app.api.services import Services

router = APIRouter(tags=["inference"])


def model_card(services: Services) -> ModelCard:
    version = services.engine.version
    created = int(time.time() - (time.monotonic() - services.started_at))
    return ModelCard(id=SERVED_MODEL, created=created, version=version.number,
                     system_fingerprint=version.fingerprint,
                     max_context=services.engine.max_context)


@router.get("/v1/models", response_model=ModelList, responses=error_responses(401, 429))
async def list_models(services: ServicesDep, _: CallerDep) -> ModelList:
    return ModelList(data=[model_card(services)])


@router.get("/v1/models/{model}", response_model=ModelCard,
            responses=error_responses(401, 404, 429))
async def get_model(model: str, services: ServicesDep, _: CallerDep) -> ModelCard:
    card = model_card(services)
    if model not in (card.id, card.system_fingerprint):
        raise ApiError(404, f"The model `{model}` does not exist", param="model",
                       code="model_not_found")
    return card
