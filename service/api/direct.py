"""A route whose plainly valid requests skip FastAPI's request handler: the approval's hot path.

FastAPI's handler solves the route's dependencies, parses the body with `json.loads` and validates
the dict, and (0.138, for a route of an included router) builds the handler itself again at every
request: ~12% of the serving loop's CPU on a repeated approval. A `DirectRoute` reads its one
integer path parameter, the bearer credentials (deps.BEARER, the scheme of the endpoint's BearerDep)
and its JSON body itself (pydantic's JSON parser,
one pass) where each is plainly valid, then runs its endpoint in the threadpool as FastAPI would;
anything else (another content type, a path or body the model refuses) goes to FastAPI's own
handler, built once, which answers it exactly as before (its 422s, its 401s). The route is
documented by FastAPI from the endpoint's signature as any other.

Only for a route of a router included without dependencies of its own (create_app's): the handler
FastAPI builds once here is the route's own.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from dpledger.service.api.deps import BEARER
from dpledger.wire.schemas import MAX_ID

# The content type a client of this API sends (httpx, requests, the worker): any other one, with a
# charset included, is FastAPI's to accept or refuse.
JSON = "application/json"
M = TypeVar("M", bound=BaseModel)


def parsed_id(raw: object) -> int | None:
    """A path id FastAPI would read as this int (ASCII digits, 1..MAX_ID); else None."""
    if not isinstance(raw, str) or not raw.isascii() or not raw.isdigit():
        return None
    value = int(raw)
    return value if 1 <= value <= MAX_ID else None


def parsed_body(model: type[M], body: bytes) -> M | None:
    """The body as `model`, where pydantic's JSON parser reads it as one; else None (FastAPI answers it)."""
    try:
        return model.model_validate_json(body)
    except ValidationError:  # invalid JSON included
        return None


class DirectRoute(APIRoute):
    """An APIRoute with one integer path parameter (`id_name`) and a JSON body (`body_model`), whose
    endpoint is sync, takes (that id, the body, the bearer credentials, the request) in that order,
    and returns a Response."""

    id_name: str
    body_model: type[BaseModel]

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        built: Callable[[Request], Coroutine[Any, Any, Response]] | None = self.__dict__.get("_handler")
        if built is not None:
            return built
        standard = super().get_route_handler()

        async def handler(request: Request) -> Response:
            path_id = parsed_id(request.path_params.get(self.id_name))
            if path_id is not None and request.headers.get("content-type") == JSON:
                body = parsed_body(self.body_model, await request.body())
                if body is not None:
                    credentials = await BEARER(request)  # the route's own scheme, as its dependency reads it
                    return await run_in_threadpool(self.endpoint, path_id, body, credentials, request)
            return await standard(request)  # the body read above is kept by the request: read again, not lost

        self.__dict__["_handler"] = handler
        return handler


def direct_route(id_name: str, body_model: type[BaseModel]) -> type[DirectRoute]:
    """A DirectRoute class for one route (`add_api_route`'s `route_class_override`)."""
    return type("DirectRoute", (DirectRoute,), {"id_name": id_name, "body_model": body_model})
