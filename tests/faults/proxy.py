"""A small HTTP/1.1 proxy on 127.0.0.1 that loses what it is told to lose, for fault tests.

Every request is read whole (request line, headers, a Content-Length body), sent upstream on a new
connection with `Connection: close`, and the upstream's answer is read to its end. Rules, matched in
the order they were added and each for its next `times` matching requests, then decide what happens:

- `drop_response`: the request reaches the upstream, which answers; the client gets nothing (its
  connection is closed): the lost answer of a request that took effect.
- `drop_request`: the request never reaches the upstream; the client's connection is closed.
- `forward`: as if there were no rule (with `before` / `after` hooks, e.g. to kill a process at an
  exact point of the protocol).

`before(request)` runs before the request is forwarded (or dropped); `after(request, status)` runs
once the upstream answered, before the client is answered. An unreachable upstream closes the
client's connection, as a dead server would. Every exchange is logged in `exchanges`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Action = Literal["forward", "drop_response", "drop_request"]
IO_TIMEOUT = 60.0  # seconds a socket may wait for one read or write
MAX_HEADER = 64 * 1024


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # with its query string
    headers: dict[str, str]  # lower-case names
    body: bytes
    peer_port: int = 0  # the client's own port of its connection to the proxy (whose process sent it)


@dataclass
class Exchange:
    request: Request
    status: int | None  # the upstream's status, None when it was not asked or did not answer
    action: Action
    answered: bool  # whether the client got the upstream's answer
    answer: bytes = b""  # the upstream's whole answer (status line, headers, body), if any

    def json(self) -> Any:
        """The answer's body as JSON (None when there was no answer or it is not JSON)."""
        body = self.answer.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in self.answer else b""
        try:
            return json.loads(body)
        except ValueError:
            return None

    def request_json(self) -> Any:
        try:
            return json.loads(self.request.body)
        except ValueError:
            return None


@dataclass
class Rule:
    method: str | None
    path: re.Pattern[str]
    times: int
    action: Action
    body: Callable[[bytes], bool] | None = None
    before: Callable[[Request], None] | None = None
    after: Callable[[Request, int], None] | None = None
    matched: int = 0

    def matches(self, request: Request) -> bool:
        return (self.matched < self.times and (self.method is None or self.method == request.method)
                and self.path.fullmatch(request.path.split("?", 1)[0]) is not None
                and (self.body is None or self.body(request.body)))


@dataclass
class Proxy:
    """`with Proxy(upstream_port) as proxy:` listens on `proxy.url` until the block ends."""

    upstream_port: int
    upstream_host: str = "127.0.0.1"
    rules: list[Rule] = field(default_factory=list)
    exchanges: list[Exchange] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: socket.socket | None = None
    _threads: list[threading.Thread] = field(default_factory=list)
    _closing: threading.Event = field(default_factory=threading.Event)

    @property
    def port(self) -> int:
        assert self._server is not None, "the proxy is not listening"
        return int(self._server.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, path: str, *, action: Action = "forward", times: int = 1, method: str | None = "POST",
            body: Callable[[bytes], bool] | None = None, before: Callable[[Request], None] | None = None,
            after: Callable[[Request, int], None] | None = None) -> Rule:
        """A rule for the next `times` requests whose path (without its query) fully matches the
        regular expression `path` (and whose method and body match, when given)."""
        rule = Rule(method=method, path=re.compile(path), times=times, action=action, body=body, before=before, after=after)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def seen(self, path: str, *, method: str | None = "POST") -> list[Exchange]:
        """The exchanges so far whose path fully matches `path`, in arrival order."""
        pattern = re.compile(path)
        with self._lock:
            return [e for e in self.exchanges if (method is None or e.request.method == method)
                    and pattern.fullmatch(e.request.path.split("?", 1)[0])]

    # --- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> Proxy:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        server.settimeout(0.2)
        self._server = server
        thread = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def __exit__(self, *_: object) -> None:
        self._closing.set()
        for thread in list(self._threads):
            thread.join(timeout=5)
        if self._server is not None:
            self._server.close()

    def _accept(self) -> None:
        assert self._server is not None
        while not self._closing.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(client,), name="proxy-connection", daemon=True)
            thread.start()
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)

    # --- one client connection: requests one after the other (keep-alive) ---------------------------
    def _serve(self, client: socket.socket) -> None:
        client.settimeout(IO_TIMEOUT)
        buffer = b""
        try:
            while not self._closing.is_set():
                read = _read_request(client, buffer)
                if read is None:
                    return
                request, raw, buffer = read
                request = dataclasses.replace(request, peer_port=int(client.getpeername()[1]))
                if not self._exchange(client, request, raw):
                    return
        except OSError:
            return
        finally:
            client.close()

    def _rule_for(self, request: Request) -> Rule | None:
        with self._lock:
            for rule in self.rules:
                if rule.matches(request):
                    rule.matched += 1
                    return rule
        return None

    def _exchange(self, client: socket.socket, request: Request, raw: bytes) -> bool:
        """Handles one request; False when the client's connection is to be closed."""
        rule = self._rule_for(request)
        action: Action = rule.action if rule is not None else "forward"
        if rule is not None and rule.before is not None:
            rule.before(request)
        if action == "drop_request":
            self._log(Exchange(request, None, action, answered=False))
            return False
        try:
            answer = _ask_upstream(self.upstream_host, self.upstream_port, raw)
        except OSError:
            self._log(Exchange(request, None, action, answered=False))
            return False  # as a dead server: the client sees its connection closed
        status = _status_of(answer)
        if rule is not None and rule.after is not None and status is not None:
            rule.after(request, status)
        if action == "drop_response" or status is None:
            self._log(Exchange(request, status, action, answered=False, answer=answer))
            return False
        # Logged before the client can read the answer, so a caller that got it finds it in the log.
        self._log(Exchange(request, status, action, answered=True, answer=answer))
        client.sendall(answer)
        return False  # the answer says `Connection: close` (the upstream was asked to close)

    def _log(self, exchange: Exchange) -> None:
        with self._lock:
            self.exchanges.append(exchange)


def _read_request(client: socket.socket, buffer: bytes) -> tuple[Request, bytes, bytes] | None:
    """(the request, its bytes rewritten for the upstream, what was read past it), None at EOF."""
    while b"\r\n\r\n" not in buffer:
        if len(buffer) > MAX_HEADER:
            return None
        chunk = client.recv(65536)
        if not chunk:
            return None
        buffer += chunk
    head, rest = buffer.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    method, path, _version = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    kept: list[str] = []
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
        if name.strip().lower() not in ("connection", "keep-alive"):
            kept.append(line)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise OSError("chunked request bodies are not supported by this proxy")
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = client.recv(65536)
        if not chunk:
            return None
        rest += chunk
    body, left = rest[:length], rest[length:]
    raw = "\r\n".join([lines[0], *kept, "Connection: close"]).encode("latin-1") + b"\r\n\r\n" + body
    return Request(method, path, headers, body), raw, left


def _ask_upstream(host: str, port: int, raw: bytes) -> bytes:
    """The upstream's whole answer to `raw` (it closes the connection after answering)."""
    with socket.create_connection((host, port), timeout=IO_TIMEOUT) as upstream:
        upstream.sendall(raw)
        parts = []
        while True:
            chunk = upstream.recv(65536)
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)


def _status_of(answer: bytes) -> int | None:
    match = re.match(rb"HTTP/1\.[01] (\d{3})", answer)
    return int(match.group(1)) if match else None
