"""The one place where errors become status codes: ledger errors, a mechanism that does not fit
its context (MechanismError, a 422 naming the field), and validation errors kept JSON-safe."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.types import DecoratedCallable
from sqlalchemy.exc import OperationalError

from dpledger.service.accounting.events import MechanismError
from dpledger.service.ledger.errors import (
    Conflict,
    InvalidRequest,
    NotFound,
    OverBudget,
    SettledAlready,
    Unauthorized,
)
from dpledger.service.ledger.seals import Tampered
from dpledger.service.store.db import CommitFailed
from dpledger.service.store.errors import disk_full
from dpledger.wire.schemas import OverBudgetResponse, finite_or_none


def _field_error(loc: list[str | int], msg: str, kind: str) -> dict[str, object]:
    return {"loc": loc, "msg": msg, "type": kind}


DISK_FULL = ("the ledger's disk is full: nothing of this request was written (its transaction rolled back); "
             "free space where the database lives, then retry")


def install(app: FastAPI) -> None:
    @app.exception_handler(OperationalError)
    @app.exception_handler(CommitFailed)
    @app.exception_handler(OSError)
    async def _disk_full(_: Request, error: Exception) -> JSONResponse:
        # SQLite and PostgreSQL roll the failed transaction back whole: a 503 that says so, not a bare 500.
        if not disk_full(error):
            raise error  # any other failure stays a 500, logged with its traceback
        return JSONResponse({"detail": DISK_FULL}, status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
                            headers={"Retry-After": "60"})

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, error: RequestValidationError) -> JSONResponse:
        # Pydantic echoes the offending input, which may be NaN or ±inf: not JSON. Keep where and why.
        detail = [_field_error(list(e["loc"]), e["msg"], e["type"]) for e in error.errors()]
        return JSONResponse({"detail": detail}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)

    @app.exception_handler(InvalidRequest)
    @app.exception_handler(MechanismError)
    async def _invalid(_: Request, error: InvalidRequest | MechanismError) -> JSONResponse:
        loc: list[str | int] = ["body", *[int(p) if p.isdigit() else p for p in error.field.split(".")]]
        return JSONResponse(
            {"detail": [_field_error(loc, error.message, "value_error")]},
            status_code=status.HTTP_422_UNPROCESSABLE_CONTENT,
        )

    @app.exception_handler(Unauthorized)
    async def _unauthorized(_: Request, error: Unauthorized) -> JSONResponse:
        return JSONResponse(
            {"detail": str(error)}, status_code=status.HTTP_401_UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"}
        )

    @app.exception_handler(NotFound)
    async def _not_found(_: Request, error: NotFound) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, status_code=status.HTTP_404_NOT_FOUND)

    @app.exception_handler(SettledAlready)
    async def _settled(_: Request, error: SettledAlready) -> JSONResponse:
        # Machine-readable, so a client that retried a commit can tell "done already" from a refusal.
        return JSONResponse({"detail": str(error), "charge_status": error.status}, status_code=status.HTTP_409_CONFLICT)

    @app.exception_handler(Conflict)
    async def _conflict(_: Request, error: Conflict) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, status_code=status.HTTP_409_CONFLICT)

    @app.exception_handler(Tampered)
    async def _tampered(_: Request, error: Tampered) -> JSONResponse:
        # Names the record and the entry whose hash no longer recomputes, for a person and a program.
        where = {"silo_id": error.silo_id, "table": "silos", "entry_seq": error.seq, "entry_event": error.event.value}
        return JSONResponse({"detail": str(error), "tampered": where}, status_code=status.HTTP_409_CONFLICT)

    @app.exception_handler(OverBudget)
    async def _over_budget(_: Request, error: OverBudget) -> JSONResponse:
        body = OverBudgetResponse(
            detail=str(error),
            epsilon=error.budget,
            epsilon_spent=finite_or_none(error.epsilon_spent),
            epsilon_if_approved=finite_or_none(error.epsilon_if_approved),
            epsilon_dp_accounting=None if error.epsilon_dp_accounting is None else finite_or_none(error.epsilon_dp_accounting),
        )
        return JSONResponse(body.model_dump(), status_code=status.HTTP_409_CONFLICT)



def spend_route(
    router: APIRouter, path: str, *, model: type, name: str, replay: str, over_budget: str,
    route_class: type[APIRoute] | None = None,
) -> Callable[[DecoratedCallable], DecoratedCallable]:
    """POST `path` as a route that may spend budget: 201 a fresh spend, and besides it the documented
    replay of the idempotency key (200, the same model) and refusal over budget (409)."""

    def register(endpoint: DecoratedCallable) -> DecoratedCallable:
        router.add_api_route(
            path, endpoint, methods=["POST"], status_code=status.HTTP_201_CREATED, response_model=model, name=name,
            responses={
                200: {"model": model, "description": f"a replay (header Idempotent-Replayed: true): {replay}"},
                409: {"model": OverBudgetResponse, "description": f"over budget: {over_budget}"},
            },
            route_class_override=route_class,
        )
        return endpoint

    return register
