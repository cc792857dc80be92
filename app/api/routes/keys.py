"""Inference keys (admin bearer token): `POST /admin/keys` makes one for a user (the whole key
is in this answer only), `GET /admin/keys` lists them without secrets, `DELETE
/admin/keys/{key_id}` revokes one (every replica refuses it within `api_keys.RECHECK_S`).
`flywheel keys create|list|revoke` does the same on the database directly."""

from __future__ import annotations

from fastapi import APIRouter, status

from app.api.api_keys import create_key, list_keys, revoke_key
from app.api.deps import AdminDep, ServicesDep
from app.api.errors import ApiError, error_responses
from app.api.schemas import KeyCreated, KeyInfo, KeyRequest

router = APIRouter(prefix="/admin/keys", tags=["admin"])


@router.post("", status_code=status.HTTP_201_CREATED, response_model=KeyCreated,
             responses=error_responses(401, 422))
def make_key(body: KeyRequest, services: ServicesDep, _: AdminDep) -> KeyCreated:
    row, key = create_key(services.db, user_id=body.user_id, rps=body.rps, label=body.label,
                          private=body.private)
    return KeyCreated(**row.model_dump(exclude={"secret_sha256"}), key=key)


@router.get("", response_model=list[KeyInfo], responses=error_responses(401))
def keys(services: ServicesDep, _: AdminDep) -> list[KeyInfo]:
    return [KeyInfo(**row.model_dump(exclude={"secret_sha256"}))
            for row in list_keys(services.db)]


@router.delete("/{key_id}", response_model=KeyInfo, responses=error_responses(401, 404))
def revoke(key_id: str, services: ServicesDep, _: AdminDep) -> KeyInfo:
    row = revoke_key(services.db, key_id)
    if row is None:
        raise ApiError(404, f"no inference key {key_id}", param="key_id", code="key_not_found")
    return KeyInfo(**row.model_dump(exclude={"secret_sha256"}))
