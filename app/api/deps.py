"""`Annotated[..., Depends(...)]` aliases the routes take."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlmodel import Session

from app.api.api_keys import ApiKeyError, Caller
from app.api.errors import ApiError
from app.api.services import Services


async def get_services(request: Request) -> Services:  # async: FastAPI runs a def in a thread
    return request.app.state.services  # type: ignore[no-any-return]


ServicesDep = Annotated[Services, Depends(get_services)]


def get_db(services: ServicesDep) -> Iterator[Session]:
    with Session(services.db) as session:
        yield session


DbDep = Annotated[Session, Depends(get_db)]
_bearer = HTTPBearer(auto_error=False)


def require_admin(services: ServicesDep,
                  creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
                  ) -> None:
    expected = services.admin_token().get_secret_value()
    if creds is None or not hmac.compare_digest(creds.credentials, expected):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "admin bearer token required",
                            headers={"WWW-Authenticate": "Bearer"})


AdminDep = Annotated[None, Depends(require_admin)]


async def inference_caller(services: ServicesDep, request: Request) -> Caller | None:
    """The caller of a /v1 route by its inference key, when keys are required (else None:
    anyone may call, and the body's `user` is logged); 401 or 429 in the API's error shape."""
    if not services.settings.api_keys_required:
        return None
    try:
        return services.key_check().check(request.headers.get("authorization"))
    except ApiKeyError as refused:
        headers = ({"Retry-After": str(refused.retry_after_s)} if refused.status == 429
                   else {"WWW-Authenticate": "Bearer"})
        raise ApiError(refused.status, refused.message, headers=headers,
                       code="rate_limit_exceeded" if refused.status == 429
                       else "invalid_api_key") from None


CallerDep = Annotated[Caller | None, Depends(inference_caller)]
