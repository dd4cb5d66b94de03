"""`dpledger witness`: a small process an auditor or a partner site runs, so that showing two parties
two different logs needs the witnesses' collusion too (c2sp.org/tlog-cosignature's witness, pulling).

Every `--interval` seconds (or once, with `--once`) it fetches the ledger's checkpoint
(GET /v1/log/checkpoint), checks the log's signature under the log's verifier key it pinned, asks the
ledger for a consistency proof from the checkpoint it last cosigned (its state file) to the new one
and verifies it (RFC 9162 §2.1.4.2, `dpledger.wire.merkle`), and only then cosigns: a cosignature/v1
line after the log's own, "as of time t, this is the largest consistent tree I have seen". It serves
its latest cosigned checkpoint at http://127.0.0.1:PORT/checkpoint and writes it to `--out`.

A checkpoint that does not extend the one it cosigned (a fork, a rollback, a proof that fails) is
refused: logged as JSON with both checkpoints and the proof served, kept in the state file, and the
witness goes on serving its last good cosignature. The first checkpoint is trusted on first use.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from dpledger.wire import merkle, note
from dpledger.wire.note import NoteError, SignedCheckpoint, VerifierKey

log = logging.getLogger("dpledger.witness")
KEPT_REFUSALS = 20  # the state file keeps the latest refusals' evidence; the log keeps every one


class LedgerLog:
    """The ledger's log as a witness or a silo reads it: its checkpoint and consistency proofs."""

    def __init__(self, url: str, key: str, *, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)

    def _get(self, path: str, params: dict[str, Any] | None = None) -> httpx.Response:
        answer = self._http.get(path, params=params)
        if answer.status_code != 200:
            raise FetchError(f"HTTP {answer.status_code} from {self.url}{path}: {answer.text[:200]}")
        return answer

    def checkpoint(self) -> str:
        return self._get("/v1/log/checkpoint").text

    def consistency(self, first: int, second: int) -> list[bytes]:
        path = self._get("/v1/log/proofs/consistency", {"first": first, "second": second}).json()["path"]
        return [bytes.fromhex(h) for h in path]

    def json(self, path: str, params: dict[str, Any] | None = None) -> Any:
        return self._get(path, params).json()

    def close(self) -> None:
        self._http.close()


class FetchError(RuntimeError):
    """The ledger could not be read: not a finding, the witness asks again next time."""


@dataclass
class State:
    cosigned: str | None = None  # the latest checkpoint this witness cosigned, as served
    refusals: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> State:
        if not path.exists():
            return cls()
        data = json.loads(path.read_text())
        return cls(cosigned=data.get("cosigned"), refusals=list(data.get("refusals", [])))

    def save(self, path: Path) -> None:
        write_atomically(path, json.dumps({"cosigned": self.cosigned, "refusals": self.refusals}, indent=2) + "\n")


def write_atomically(path: Path, text: str) -> None:
    # A crash mid-write must never leave a witness without the checkpoint it last vouched for.
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


class Witness:
    def __init__(self, *, ledger: LedgerLog, log_key: VerifierKey, signer: note.Signer, state_path: Path,
                 out: Path | None = None, clock: Callable[[], float] = time.time) -> None:
        if signer.verifier.signature_type != note.COSIGNATURE_V1:
            raise NoteError("a witness signs with a cosignature/v1 key (type 0x04): `dpledger witness keys create`")
        self.ledger, self.log_key, self.signer = ledger, log_key, signer
        self.state_path, self.out, self.clock = state_path, out, clock
        self.state = State.load(state_path)
        self._lock = threading.Lock()
        if self.state.cosigned is not None:
            self.held()  # a state file that is not this witness's own cosignature of this log: refuse to start

    def held(self) -> SignedCheckpoint | None:
        if self.state.cosigned is None:
            return None
        return note.open_checkpoint(self.state.cosigned, self.log_key, also=[self.signer.verifier])

    @property
    def cosigned(self) -> str | None:
        with self._lock:
            return self.state.cosigned

    def poll(self) -> tuple[bool, str]:
        """One round: (True, what was cosigned) or (False, why it was refused). FetchError if the
        ledger could not be read."""
        served = self.ledger.checkpoint()
        held = self.held()
        try:
            new = note.open_checkpoint(served, self.log_key)
        except NoteError as error:
            return self._refuse(f"the served checkpoint does not verify under the pinned log key: {error}", held, served)
        if held is not None:
            old, fresh = held.checkpoint, new.checkpoint
            if fresh.size < old.size:
                return self._refuse(f"ROLLBACK: the log shrank from {old.size} to {fresh.size} leaves", held, served)
            if fresh.size == old.size and fresh.root_hash != old.root_hash:
                return self._refuse(f"FORK: two checkpoints of size {old.size} signed by the log's key with different roots",
                                    held, served)
            if fresh.size > old.size:
                proof = self.ledger.consistency(old.size, fresh.size)
                try:
                    merkle.verify_consistency(first=old.size, second=fresh.size, first_root=old.root_hash,
                                              second_root=fresh.root_hash, path=proof)
                except merkle.ProofError as error:
                    return self._refuse(f"FORK: the checkpoint of size {fresh.size} does not extend the one of size "
                                        f"{old.size} cosigned: {error}", held, served, proof)
        return True, self._cosign(new)

    def _cosign(self, new: SignedCheckpoint) -> str:
        log_signature = new.opened.by(self.log_key)
        assert log_signature is not None  # open_checkpoint checked it
        stamp = int(self.clock())
        held = self.held()
        if held is not None:
            previous = held.opened.by(self.signer.verifier)
            stamp = max(stamp, previous.timestamp if previous is not None else 0)  # a witness's time never goes back
        text = note.sign(new.checkpoint.body(), [self.signer], existing=[log_signature], timestamp=stamp)
        with self._lock:
            self.state.cosigned = text
            self.state.save(self.state_path)
        if self.out is not None:
            write_atomically(self.out, text)
        return f"cosigned size {new.checkpoint.size} root {new.checkpoint.root_hash.hex()} at time {stamp}"

    def _refuse(self, reason: str, held: SignedCheckpoint | None, served: str,
                proof: list[bytes] | None = None) -> tuple[bool, str]:
        evidence = {"time": int(self.clock()), "refused": reason, "log_key": self.log_key.encode(),
                    "cosigned": held.text if held is not None else None, "served": served,
                    "consistency_proof": None if proof is None else [p.hex() for p in proof]}
        log.error("refused to cosign: %s", json.dumps(evidence))
        with self._lock:
            self.state.refusals = [*self.state.refusals, evidence][-KEPT_REFUSALS:]
            self.state.save(self.state_path)
        return False, reason


def serve(witness: Witness, port: int) -> ThreadingHTTPServer:
    """GET /checkpoint on 127.0.0.1:`port`: the latest cosigned checkpoint (404 before the first)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            text = witness.cosigned if self.path.split("?")[0] == "/checkpoint" else None
            body = (text or "no cosigned checkpoint here\n").encode()
            self.send_response(200 if text is not None else 404)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug(format, *args)

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, name="witness-http", daemon=True).start()
    return server


def run(witness: Witness, *, interval: float, rounds: int | None = None) -> None:
    """Polls every `interval` seconds (`rounds` times, or until interrupted)."""
    done = 0
    while rounds is None or done < rounds:
        try:
            cosigned, said = witness.poll()
            (log.info if cosigned else log.error)("%s", said)
        except (FetchError, httpx.HTTPError, ValueError) as error:  # ValueError: a body that is not what the API says
            log.warning("could not read the ledger at %s: %s (serving the last cosignature)", witness.ledger.url, error)
        done += 1
        if rounds is None or done < rounds:
            time.sleep(interval)
