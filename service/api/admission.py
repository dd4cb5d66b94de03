"""Bounded per key as well as per request (issue 46): a request's work is priced and guarded
(accounting/cost.py), and here each key may hold only a few requests in flight on the routes that
compute, and no request body may be larger than any real request is.

A price bounds one request to ~2 s of CPU, but a key could still send sixteen such requests at once
and hold every thread of the pool (and both cores) for seconds, while other silos' approvals wait.
So the routes that compute (quotes, calibrations, plans, registrations, searches) admit at most
MAX_IN_FLIGHT request per key in each serving process, and answer 429 with `Retry-After` beyond:
nothing is queued, so nothing waits on a thread. Approvals (`POST /v1/silos/{id}/charges`) are not
behind it: their price is bounded like every request's, and their hot path takes no dependency.

The body limit comes first: parsing and validating a mechanism costs CPU in proportion to its JSON
before any price is read (a 1.3 MB rounds quote of 32,000 Gaussians took ~1 s), and no request a
person or the worker sends comes near MAX_BODY_BYTES.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, status
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dpledger.service.api.deps import Principal, PrincipalDep

# Per key and serving process, on the routes that compute. One: a key that keeps 16 worst-case
# quotes in flight then leaves another silo's approvals ~1.5× their quiet latency on 2 cores; at two
# in flight it held both cores and left them ~2.8× (bench/hostile_requests.py).
MAX_IN_FLIGHT = 1
RETRY_AFTER_S = 1  # a priced request ends within ~2 s of CPU
MAX_BODY_BYTES = 1024 * 1024  # 10,000 mechanism nodes (cost.MAX_NODES) are ~0.5 MB of JSON


class InFlight:
    """How many requests each key has in flight on the routes that compute, in this process."""

    def __init__(self, limit: int = MAX_IN_FLIGHT) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._held: dict[int, int] = {}

    def enter(self, key_id: int) -> bool:
        with self._lock:
            held = self._held.get(key_id, 0)
            if held >= self.limit:
                return False
            self._held[key_id] = held + 1
            return True

    def leave(self, key_id: int) -> None:
        with self._lock:
            held = self._held.get(key_id, 0) - 1
            if held > 0:
                self._held[key_id] = held
            else:
                self._held.pop(key_id, None)


async def admitted(request: Request, caller: PrincipalDep) -> AsyncIterator[Principal]:
    """The caller, holding one of its key's in-flight slots until its request's work is done."""
    in_flight: InFlight = request.app.state.in_flight
    if not in_flight.enter(caller.key_id):
        raise HTTPException(
            status.HTTP_429_TOO_MANY_REQUESTS,
            f"this key has {in_flight.limit} request(s) in flight on routes that compute, the most one key may have: "
            f"retry after {RETRY_AFTER_S} s, or wait for an answer before the next request",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    try:
        yield caller
    finally:
        in_flight.leave(caller.key_id)


# A route that computes takes this in place of PrincipalDep.
AdmittedDep = Annotated[Principal, Depends(admitted)]
TOO_MANY: dict[int | str, dict[str, Any]] = {
    429: {"description": "this key has too many requests in flight on routes that compute (see Retry-After)"}}


class BodyLimit:
    """Refuses (413) a request body larger than MAX_BODY_BYTES, by its Content-Length before reading
    it, or while it streams in without one."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                if value.isdigit() and int(value) > self.limit:
                    await self._refuse(send)
                    return
                await self.app(scope, receive, send)  # the server delivers no more than it declared
                return
        if scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        await self._streamed(scope, receive, send)

    async def _streamed(self, scope: Scope, receive: Receive, send: Send) -> None:
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = (b'{"detail":"the request body is larger than ' + str(self.limit).encode()
                + b' bytes, more than any request to this service needs"}')
        await send({"type": "http.response.start", "status": status.HTTP_413_CONTENT_TOO_LARGE,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass
