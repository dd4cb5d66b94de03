"""Runs the app under uvicorn, one process or a supervisor and N workers, with Nagle's algorithm
off on every connection whatever N is.

uvicorn binds the listening socket itself when it starts several workers, and creates it with
`proto` 0; accepted sockets inherit that, and asyncio turns TCP_NODELAY on only for sockets that
report IPPROTO_TCP. Every keep-alive request after the first then waits for the client's delayed
ACK: ~44 ms for /healthz with `--workers 2` against ~1 ms with one worker, measured here (uvicorn
0.54; uvicorn issue #3149, open). The worker asks for approval before every round, one request
after the other, so that is paid on every round. The listener is re-wrapped with IPPROTO_TCP here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import inspect
import logging
import os
import signal
import socket
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from uvicorn.supervisors import Multiprocess

from dpledger.service.api.ledger_file import LedgerInUse

if TYPE_CHECKING:
    from fastapi import FastAPI

APP = "dpledger.service.serving:served_app"
supervisor_log = logging.getLogger("uvicorn.error")
# A child that has not answered the supervisor's health check in this long is killed and replaced.
# uvicorn's default is 5 s; a child still importing the app on busy cores misses it, and was killed
# over and over ("Child process [N] died" 15 times, ready after 107 s with --workers 4 under load).
WORKER_HEALTHCHECK_S = 60
# How often the supervisor pings its workers. uvicorn pings every one every 0.5 s (twice over, once the
# check above that says why was added): each ping is a pipe round trip for the supervisor and a wake-up
# of the worker's answering thread, CPU paid all day at rest. A worker that died is replaced within this.
WORKER_CHECK_S = 5.0


def served_app() -> FastAPI:
    """The app as each serving process runs it: built, then its objects frozen out of the garbage
    collector's reach (gc.freeze). They live as long as the process, yet every full collection would
    walk all of them again (SQLAlchemy's, FastAPI's, numpy's, dp-accounting's): ~9% of the server's
    CPU per approval, measured (docs/benchmarks.md). What requests allocate is collected as before."""
    from dpledger.service.api.app import create_app  # in the worker: a supervisor never builds the app
    from dpledger.service.api.ledger_file import join_ledger
    from dpledger.service.settings import get_settings

    join_ledger(get_settings().database_url)  # so that a server started after its supervisor died sees it
    app = create_app()
    gc.collect()  # what building it left behind goes now, not frozen for good
    gc.freeze()
    return app


class _NoDelayConfig(uvicorn.Config):
    def bind_socket(self) -> socket.socket:
        sock = super().bind_socket()
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.proto != socket.IPPROTO_TCP:
            sock = socket.socket(sock.family, sock.type, socket.IPPROTO_TCP, fileno=sock.detach())
            sock.set_inheritable(True)
        return sock


# How often a serving process's event loop wakes with nothing to do (uvicorn's own: every 0.1 s).
TICK_S = 1.0


class _QuietServer(uvicorn.Server):
    """uvicorn's server, whose loop wakes once a second at rest instead of ten times: its tick only
    looks for an exit and refreshes the Date header (once a second either way), yet ten wake-ups a
    second cost a ledger at rest ~1.5 ms of CPU a second, measured (bench/idle.py). An exit signal
    wakes the loop at once, so stopping takes no longer than before."""

    _loop: asyncio.AbstractEventLoop | None = None
    _wake: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864000  # on_tick does its once-a-second work at multiples of 10
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            should_exit = await self.on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)  # from the signal handler, in the loop's thread


def share_development_key() -> None:
    """Without a configured signing key (development only), every worker would make up its own and
    sign heads under different keys: make one here, for all of them, through the environment."""
    from dpledger.service.ledger.signer import ephemeral_seed, log
    from dpledger.service.settings import get_settings

    settings = get_settings()
    if settings.signing_key_file is None and settings.signing_key is None and settings.env == "development":
        os.environ["DPLEDGER_SIGNING_KEY"] = ephemeral_seed()
        get_settings.cache_clear()
        log.warning("no DPLEDGER_SIGNING_KEY_FILE: this server's workers sign tree heads with an ephemeral key that "
                    "dies with it; receipts cannot be checked after a restart (development only)")


def serve(*, host: str, port: int, workers: int, **options: Any) -> None:
    """uvicorn.run's own dispatch for an import string, with the listener above."""
    from dpledger.service.api.ledger_file import hold_ledger
    from dpledger.service.settings import get_settings

    hold_ledger(get_settings().database_url)  # first: a refused second server writes and logs nothing
    share_development_key()
    options.setdefault("timeout_worker_healthcheck", WORKER_HEALTHCHECK_S)
    config = _NoDelayConfig(APP, factory=True, host=host, port=port, workers=workers, **options)
    if config.workers > 1:
        supervisor: Any = _Supervisor  # its signature depends on the installed uvicorn, see _supervisor_args
        supervisor(config, **_supervisor_args(config)).run()
    else:
        _QuietServer(config).run()


def why_it_died(exitcode: int | None, *, timeout: float) -> str:
    """What a replaced worker's end was, in words: uvicorn says only "Child process [N] died"."""
    if exitcode is None:
        return f"did not answer the supervisor's health check within {timeout:g} s (hung or starved of CPU): killed"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (by the kernel's out-of-memory killer, or an operator)" if -exitcode == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with status {exitcode}" + (" (its error is logged above)" if exitcode else "")


class _Supervisor(Multiprocess):
    """uvicorn's supervisor, saying why each worker it replaces ended: it logs only "Child process [N]
    died". Its own loop still replaces them, whatever its version; it is handed the ended ones alone,
    since it pings every worker it is given, and each is pinged once a check, every WORKER_CHECK_S."""

    _next_check = 0.0

    def keep_subprocess_alive(self) -> None:
        if self.should_exit.is_set() or time.monotonic() < self._next_check:
            return
        self._next_check = time.monotonic() + WORKER_CHECK_S
        timeout = self.config.timeout_worker_healthcheck
        ended: list[int] = []
        for index, process in enumerate(self.processes):
            child = process.process
            if child.is_alive():
                if process.is_alive(timeout=timeout):
                    continue
                # Ended here, so that uvicorn's loop below finds it ended and does not ping it again.
                process.kill()
                process.join()
                why = why_it_died(None, timeout=timeout)
            else:
                why = why_it_died(child.exitcode, timeout=timeout)
            ended.append(index)
            if not self.should_exit.is_set():
                supervisor_log.warning(f"worker process [{process.pid}] {why}; starting another")
        if ended:
            everyone, self.processes = self.processes, [self.processes[index] for index in ended]
            try:
                super().keep_subprocess_alive()
            finally:
                for index, replacement in zip(ended, self.processes, strict=True):
                    everyone[index] = replacement
                self.processes = everyone


def _supervisor_args(config: uvicorn.Config) -> dict[str, Any]:
    """uvicorn < 0.51 (what Flower 1.41 pins: `uvicorn<0.50`) wants the worker's `target`;
    0.51 and later build the server in each worker themselves and take no target (their workers then
    run uvicorn's own loop, not _QuietServer's)."""
    arguments: dict[str, Any] = {"sockets": [config.bind_socket()]}
    if "target" in inspect.signature(Multiprocess.__init__).parameters:
        arguments["target"] = _QuietServer(config).run
    return arguments


def main(argv: list[str] | None = None) -> None:
    """`python -m dpledger.service.serving`: what `dpledger.harness.ServerProcess` starts (no migration, no
    JSON logging; `dpledger serve` does both)."""
    parser = argparse.ArgumentParser(prog="python -m dpledger.service.serving")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    try:
        serve(host=args.host, port=args.port, workers=args.workers, log_level=args.log_level)
    except LedgerInUse as refused:  # the harness's start: one line too, as `dpledger serve` says it
        print(f"dpledger serve: {refused}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
