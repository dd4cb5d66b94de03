"""The one typed client of the ledger: the worker's, the Flower apps', and the people and audit
commands' (`dpledger silos|history|charges|verify|audit|pubkey`). httpx and pydantic only, no torch,
so that the commands run from outside the ledger (dpledger.people, dpledger.audit) import it as the
worker does.

Requests are the wire's pydantic models (a mechanism given as a plain mapping is validated into one
before it is sent); answers are parsed into the wire's response models. Errors form one tree
(`dpledger.wire.errors`): `Denied` (over budget, final), `Rejected` (any other 4xx, never retried),
`Unreachable` (connection errors, timeouts and 5xx, retried with exponential backoff up to a bound;
then the caller stops without spending more), and the round protocol's `NotOwned`.

Retrying a reservation is safe because it carries an idempotency key; the answer then says whether
it replayed an earlier request (`Reservation.replayed`). Each call to `reserve` also sends a random
attempt id (the same on that call's own retries); the ledger keeps the first attempt's id with the
charge and answers it on every replay. Only a reservation whose stored id is this call's own lets a
round touch the data (`Reservation.owned`): a 201, or the replay that answers this very call's
retry after its first answer was lost. Another delivery of the same round finds someone else's id.
Retrying a commit is made safe by the service's machine-readable `charge_status` on a second
settlement. Retries are bounded in time (`Retry.window`, 60 s unless $DPLEDGER_RETRY_WINDOW says
otherwise): long enough to ride out a ledger restart, short enough to give up on an outage.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from dpledger.wire import receipt_store
from dpledger.wire.enums import ChargeStatus, Role
from dpledger.wire.errors import Denied, LedgerError, Rejected, Unreachable
from dpledger.wire.log_proofs import LogProofs
from dpledger.wire.mechanisms import AnyMechanism, Mechanism
from dpledger.wire.receipts import (
    HeadError,
    InclusionProof,
    LogLeaf,
    PublicKey,
    Receipt,
    SignedTreeHead,
    check_receipt,
    default_receipts_dir,
    key_id,
)
from dpledger.wire.schemas import (
    CalibrateResponse,
    ChargeReserved,
    ChargeSettled,
    GroupsResponse,
    HistoryEntry,
    JobCreated,
    KeyCreated,
    KeyInfo,
    OverBudgetResponse,
    QuoteResponse,
    RoundsQuote,
    SiloCalibration,
    SiloCreated,
    SiloDetail,
    SiloSummary,
    VerifyResponse,
)
from dpledger.wire.searches import DistributionKind, SearchDetail, SearchStarted

_MECHANISM: TypeAdapter[AnyMechanism] = TypeAdapter(Mechanism)
_HISTORY: TypeAdapter[list[HistoryEntry]] = TypeAdapter(list[HistoryEntry])
_SILOS: TypeAdapter[list[SiloSummary]] = TypeAdapter(list[SiloSummary])
_CHARGES: TypeAdapter[list[ChargeReserved]] = TypeAdapter(list[ChargeReserved])
_LEAVES: TypeAdapter[list[LogLeaf]] = TypeAdapter(list[LogLeaf])
ModelT = TypeVar("ModelT", bound=BaseModel)
log = logging.getLogger("dpledger.client")
# A kept promise is completed (its inclusion and a signed head fetched) at the client's next answer
# once it is this old (the sequencer runs every ≤ 100 ms), at most once per COMPLETE_EVERY_S, and at close.
COMPLETE_AFTER_S = 0.2
COMPLETE_EVERY_S = 1.0


@dataclass(frozen=True)
class Reservation:
    """An approved reservation.

    `status` is the charge's real state as the service answered it (a replay of a settled charge
    says committed or released); `replayed` is true when the key named an earlier request;
    `attempt_id` is the id of the attempt that made the charge, `own_attempt_id` this call's.
    """

    charge_id: int
    epsilon_spent: float
    epsilon_remaining: float
    status: ChargeStatus = ChargeStatus.reserved
    replayed: bool = False
    attempt_id: str | None = None
    own_attempt_id: str | None = None

    @property
    def owned(self) -> bool:
        """This call's own open reservation, the only one it may spend: reserved, and made by this
        very call (a replay answers its own retry only when the stored attempt id is its own)."""
        return (
            self.status is ChargeStatus.reserved and self.attempt_id is not None
            and self.attempt_id == self.own_attempt_id
        )


RETRY_WINDOW_ENV = "DPLEDGER_RETRY_WINDOW"


def _default_window() -> float:
    raw = os.environ.get(RETRY_WINDOW_ENV)
    if raw is None:
        return 60.0
    try:
        window = float(raw)
    except ValueError:
        raise ValueError(f"{RETRY_WINDOW_ENV} must be a number of seconds. Found {raw!r}.") from None
    if not (math.isfinite(window) and window >= 0):
        raise ValueError(f"{RETRY_WINDOW_ENV} must be a finite number of seconds >= 0. Found {raw!r}.")
    return window


@dataclass(frozen=True)
class Retry:
    """Exponential backoff (first_delay, ×factor, at most max_delay apart) for up to `window` seconds
    after the first attempt; the default window rides out a ledger restart (5–12 s seen)."""

    window: float = field(default_factory=_default_window)
    first_delay: float = 0.2
    factor: float = 2.0
    max_delay: float = 5.0


def _retry_after(response: httpx.Response) -> float:
    value = response.headers.get("Retry-After", "")
    return float(value) if value.isdigit() else 1.0


def _body(response: httpx.Response) -> Any:
    if response.headers.get("content-type", "").startswith("application/json"):
        return response.json()
    return response.text


@dataclass(frozen=True)
class _Answer:
    response: httpx.Response
    method: str
    path: str

    def rejected(self, body: Any = None) -> Rejected:
        """The answer as the error it is (a 4xx other than a denial), naming the request it answers."""
        return Rejected(self.response.status_code, _body(self.response) if body is None else body,
                        method=self.method, path=self.path)

    def expect(self, *ok: int) -> httpx.Response:
        if self.response.status_code not in ok:
            raise self.rejected()
        return self.response


def as_mechanism(mechanism: AnyMechanism | Mapping[str, Any]) -> AnyMechanism:
    """The wire model of a mechanism; a mapping is validated here, so a malformed one never leaves
    the worker (pydantic's ValidationError, a ValueError, names the field)."""
    if isinstance(mechanism, BaseModel):
        return mechanism
    return _MECHANISM.validate_python(dict(mechanism))


class LedgerClient:
    def __init__(self, base_url: str, api_key: str, *, transport: httpx.BaseTransport | None = None,
                 retry: Retry | None = None, timeout: float = 30.0, http: httpx.Client | None = None,
                 receipts: Path | bool = True) -> None:
        """`http`: an httpx client to send through instead of a new one (e.g. an in-process app's
        test client); the key is sent with every request either way. `receipts`: the directory to
        keep the ledger's receipts in (a folder per ledger, a file per silo: `receipt_store`), True
        for `default_receipts_dir()`, False for none."""
        self._owns_http = http is None
        self._http = http if http is not None else httpx.Client(base_url=base_url, transport=transport, timeout=timeout)
        self._headers = {"Authorization": f"Bearer {api_key}"}
        # Read here, not at import: $DPLEDGER_RETRY_WINDOW may be set after the module was imported.
        self._retry = retry if retry is not None else Retry()
        self.receipts_dir = None if receipts is False else (default_receipts_dir() if receipts is True else Path(receipts))
        self._holder = receipt_store.fingerprint(api_key)
        self._holding: set[tuple[str, int]] = set()  # (log key id, silo) noted in the holders file
        self._pending: dict[str, tuple[Receipt, float]] = {}  # leaf hash → kept promise, when kept (monotonic)
        self._last_completion = 0.0
        self._log_key: bytes | None = None

    def _keep(self, receipt: Receipt | None) -> None:
        # Appended before the answer is used: a receipt is the silo's evidence against the ledger.
        if receipt is None or self.receipts_dir is None:
            return
        key = receipt_store.key_id_of(receipt)
        receipt_store.append(self.receipts_dir, [receipt])
        if (key, receipt.silo_id) not in self._holding:
            receipt_store.add_holder(self.receipts_dir, key, receipt.silo_id, self._holder)
            self._holding.add((key, receipt.silo_id))
        now = time.monotonic()
        ripe = any(now - kept >= COMPLETE_AFTER_S for _, kept in self._pending.values())
        if not receipt.included:
            self._pending[receipt.leaf_hash] = (receipt, now)
        if ripe and now - self._last_completion >= COMPLETE_EVERY_S:
            self.complete_pending()

    def complete_pending(self) -> int:
        """Completes the promises this client kept whose leaves the sequencer has logged: each with its
        log index, the log's signed head and the path to it, checked under the key that signed the
        promise, appended beside the promise. Best effort (the answer it rides on is never failed for
        it): what is still pending waits for the next call, or for `dpledger verify --receipts`.
        Returns how many it completed."""
        if not self._pending or self.receipts_dir is None:
            return 0
        self._last_completion = time.monotonic()
        retry, self._retry = self._retry, Retry(window=0)  # one attempt: never hold a worker's round for it
        try:
            completed = self._complete([r for r, _ in self._pending.values()])
        except (LedgerError, ValidationError, OSError) as error:
            log.debug("receipts not completed yet: %s", error)
            return 0
        finally:
            self._retry = retry
        receipt_store.append(self.receipts_dir, completed)
        for receipt in completed:
            self._pending.pop(receipt.leaf_hash, None)
        return len(completed)

    def _complete(self, pending: list[Receipt]) -> list[Receipt]:
        head = self.log_head()
        if self._log_key is None:
            self._log_key = bytes.fromhex(self.log_public_key().public_key)
        done = []
        for receipt in pending:
            if receipt_store.key_id_of(receipt) != key_id(self._log_key):
                continue  # signed by a key the ledger no longer serves: `verify --receipts` says so
            try:
                proof = self.log_inclusion(receipt.leaf_hash, size=head.tree_size)
            except Rejected:  # sequenced after the head was read: the next call
                continue
            if proof is None:
                continue
            completed = receipt.model_copy(update={"log_index": proof.log_index, "tree_head": head,
                                                   "inclusion_path": proof.path})
            try:
                check_receipt(completed, self._log_key)
            except HeadError as error:  # kept as the promise alone: `verify --receipts` names what is wrong
                log.warning("the ledger's inclusion of silo %d entry %d does not verify: %s", receipt.silo_id,
                            receipt.seq, error)
                continue
            done.append(completed)
        return done

    def close(self) -> None:
        try:
            if self.receipts_dir is not None:  # and what earlier clients of these silos left pending
                for key, silo_id in self._holding:
                    for receipt in receipt_store.uncompleted_tail(self.receipts_dir, key, silo_id):
                        self._pending.setdefault(receipt.leaf_hash, (receipt, 0.0))
            self.complete_pending()
        finally:
            if self._owns_http:
                self._http.close()

    def __enter__(self) -> LedgerClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # --- transport --------------------------------------------------------------------------------
    def _send(self, method: str, path: str, body: BaseModel | Mapping[str, Any] | None = None, *,
              params: Mapping[str, Any] | None = None) -> _Answer:
        payload = body.model_dump(mode="json", exclude_none=True) if isinstance(body, BaseModel) else body
        delay, attempts = self._retry.first_delay, 0
        deadline = time.monotonic() + self._retry.window
        while True:
            attempts += 1
            last: httpx.Response | None = None
            try:
                response = self._http.request(method, path, params=params, json=payload, headers=self._headers)
            except httpx.TransportError as error:
                failure: str = f"{type(error).__name__}: {error}"
            else:
                if response.status_code < 500 and response.status_code != 429:
                    return _Answer(response, method, path)
                failure, last = f"HTTP {response.status_code}", response
                if response.status_code == 429:  # this key's request in flight on a route that computes: as told
                    delay = max(delay, _retry_after(response))
            if time.monotonic() + delay > deadline:
                raise Unreachable(
                    f"{method} {path} failed {attempts} times in {self._retry.window:g} s; last: {failure}",
                    last=failure, status_code=None if last is None else last.status_code,
                    body=None if last is None else _body(last), path=path,
                )
            time.sleep(delay)
            delay = min(delay * self._retry.factor, self._retry.max_delay)

    @staticmethod
    def _expect(answer: _Answer, model: type[ModelT], *ok: int) -> ModelT:
        return model.model_validate_json(answer.expect(*ok).content)

    @staticmethod
    def _denied_or_rejected(answer: _Answer) -> LedgerError:
        """A 409 is a denial when it carries the refusal's numbers, else a conflict (Rejected)."""
        body = _body(answer.response)
        if answer.response.status_code == 409:
            try:
                return Denied.from_response(OverBudgetResponse.model_validate(body))
            except ValidationError:
                pass
        return answer.rejected(body)

    # --- admin -----------------------------------------------------------------------------------
    def create_silo(self, *, name: str, epsilon: float, delta: float, dataset_size: int,
                    horizon: AnyMechanism | Mapping[str, Any] | None = None) -> SiloCreated:
        """`horizon`: the workload the silo expects to spend its budget on (e.g. one round of its
        DP-SGD); the ledger fixes the silo's filter order where that workload is cheapest, so a job
        that declares its own reads a tighter ε than under the default horizon."""
        body: dict[str, Any] = {"name": name, "epsilon": epsilon, "delta": delta, "dataset_size": dataset_size}
        if horizon is not None:
            body["horizon"] = as_mechanism(horizon).model_dump(mode="json", exclude_none=True)
        return self._expect(self._send("POST", "/v1/silos", body), SiloCreated, 201)

    def create_key(self, *, role: Role, silo_id: int | None = None) -> KeyCreated:
        body: dict[str, Any] = {"role": role.value}
        if silo_id is not None:
            body["silo_id"] = silo_id
        return self._expect(self._send("POST", "/v1/keys", body), KeyCreated, 201)

    def revoke_key(self, key_id: int) -> None:
        self._send("DELETE", f"/v1/keys/{key_id}").expect(204)

    def seal_silo(self, silo_id: int) -> SiloDetail:
        """Accepts a tampered silo's record as it stands (admin; POST /v1/silos/{id}/seal)."""
        return self._expect(self._send("POST", f"/v1/silos/{silo_id}/seal"), SiloDetail, 200)

    def retire_silo(self, silo_id: int, *, reason: str) -> SiloDetail:
        """Retires a mis-registered silo for good: it approves nothing from then on (admin; POST /v1/silos/{id}/retire)."""
        return self._expect(self._send("POST", f"/v1/silos/{silo_id}/retire", {"reason": reason}), SiloDetail, 200)

    # --- a silo's own ------------------------------------------------------------------------------
    def silo(self, silo_id: int) -> SiloDetail:
        return self._expect(self._send("GET", f"/v1/silos/{silo_id}"), SiloDetail, 200)

    def history(self, silo_id: int) -> list[HistoryEntry]:
        return _HISTORY.validate_json(self._send("GET", f"/v1/silos/{silo_id}/history").expect(200).content)

    def reserve(self, silo_id: int, *, mechanism: AnyMechanism | Mapping[str, Any], idempotency_key: str,
                job_id: str | None = None, round: int | None = None) -> Reservation:
        attempt_id = secrets.token_urlsafe(16)  # this call's, reused by its own retries in _send
        body = {"mechanism": as_mechanism(mechanism).model_dump(mode="json", exclude_none=True),
                "idempotency_key": idempotency_key, "job_id": job_id, "round": round, "attempt_id": attempt_id}
        answer = self._send("POST", f"/v1/silos/{silo_id}/charges", body)
        response = answer.response
        if response.status_code not in (200, 201):
            raise self._denied_or_rejected(answer)
        data = ChargeReserved.model_validate_json(response.content)
        self._keep(data.receipt)
        replayed = data.replayed or response.status_code == 200
        # null is an infinite ε (JSON has no infinity): only a replay of a charge settled long ago can say so.
        spent = math.inf if data.epsilon_spent is None else data.epsilon_spent
        return Reservation(
            charge_id=data.charge_id, epsilon_spent=spent, epsilon_remaining=data.epsilon_remaining,
            status=ChargeStatus(data.status), replayed=replayed, attempt_id=data.attempt_id, own_attempt_id=attempt_id,
        )

    def commit(self, charge_id: int) -> float | None:
        return self._settle(charge_id, "commit", done=ChargeStatus.committed)

    def release(self, charge_id: int) -> float | None:
        return self._settle(charge_id, "release", done=ChargeStatus.released)

    def _settle(self, charge_id: int, action: Literal["commit", "release"], *, done: ChargeStatus) -> float | None:
        """The silo's ε after the settlement, or None when an earlier attempt had landed already."""
        try:
            return self.settle_charge(charge_id, action).epsilon_spent
        except Rejected as error:
            if error.status_code == 409 and isinstance(error.body, dict) and error.body.get("charge_status") == done.value:
                return None  # an earlier attempt landed and only its answer was lost
            raise

    def settle_charge(self, charge_id: int, action: Literal["commit", "release"]) -> ChargeSettled:
        """The settlement as the ledger answers it; any refusal (a 409 included) raises Rejected. A
        person releasing a stranded reservation (`dpledger charges release`) sees it as it is."""
        settled = self._expect(self._send("POST", f"/v1/charges/{charge_id}/{action}"), ChargeSettled, 200)
        self._keep(settled.receipt)
        return settled

    def calibrate_silo(self, silo_id: int, *, batch_size: int, steps_per_round: int, rounds: int) -> SiloCalibration:
        """σ such that `rounds` more rounds fit what this silo has left (its key or an admin's)."""
        body = {"batch_size": batch_size, "steps_per_round": steps_per_round, "rounds": rounds}
        return self._expect(self._send("POST", f"/v1/silos/{silo_id}/calibrate", body), SiloCalibration, 200)

    # --- searches ------------------------------------------------------------------------------------
    def start_search(self, silo_id: int, *, trial: AnyMechanism | Mapping[str, Any], mean_trials: float,
                     distribution: DistributionKind, shape: float | None = None, idempotency_key: str) -> SearchStarted:
        law: dict[str, Any] = {"kind": distribution}
        if shape is not None:
            law["shape"] = shape
        body = {"trial": as_mechanism(trial).model_dump(mode="json", exclude_none=True), "mean_trials": mean_trials,
                "distribution": law, "idempotency_key": idempotency_key}
        answer = self._send("POST", f"/v1/silos/{silo_id}/searches", body)
        if answer.response.status_code != 201:
            raise self._denied_or_rejected(answer)
        started = SearchStarted.model_validate_json(answer.response.content)
        self._keep(started.receipt)
        return started

    def report_trial(self, search_id: int, *, score: float) -> SearchDetail:
        return self._expect(self._send("POST", f"/v1/searches/{search_id}/trials", {"score": score}), SearchDetail, 200)

    # --- jobs, norms and groups (the coordinator's side) -------------------------------------------
    def create_job(self, *, name: str, silo_ids: list[int]) -> int:
        return self._expect(self._send("POST", "/v1/jobs", {"name": name, "silo_ids": silo_ids}), JobCreated, 201).job_id

    def report_norm(self, job_id: int, round: int, *, silo_id: int, l2_norm: float) -> None:
        self._send("POST", f"/v1/jobs/{job_id}/rounds/{round}/norms", {"silo_id": silo_id, "l2_norm": l2_norm}).expect(201)

    def groups(self, job_id: int, round: int) -> dict[int, int]:
        """Silo id → privacy group (0 = least noisy), from the norms alone."""
        return self._expect(self._send("GET", f"/v1/jobs/{job_id}/rounds/{round}/groups"), GroupsResponse, 200).groups

    # --- anyone ------------------------------------------------------------------------------------
    def who_am_i(self) -> KeyInfo:
        """The key's id, role and silo (GET /v1/keys/me)."""
        return self._expect(self._send("GET", "/v1/keys/me"), KeyInfo, 200)

    def history_page(self, silo_id: int, *, after_seq: int, limit: int) -> list[HistoryEntry]:
        answer = self._send("GET", f"/v1/silos/{silo_id}/history", params={"after_seq": after_seq, "limit": limit})
        return _HISTORY.validate_json(answer.expect(200).content)

    def history_csv_page(self, silo_id: int, *, after_seq: int, limit: int) -> str:
        """The same page as the API's CSV export (with its header row)."""
        params = {"format": "csv", "after_seq": after_seq, "limit": limit}
        return self._send("GET", f"/v1/silos/{silo_id}/history", params=params).expect(200).text

    def quote(self, mechanism: AnyMechanism | Mapping[str, Any], *, silo_id: int | None = None,
              delta: float | None = None) -> QuoteResponse:
        """What `mechanism` costs alone, and (with silo_id) the silo's ε if it were added: the
        service's own accounting, so a plan and an approval agree."""
        body: dict[str, Any] = {"mechanism": as_mechanism(mechanism).model_dump(mode="json", exclude_none=True)}
        if silo_id is not None:
            body["silo_id"] = silo_id
        if delta is not None:
            body["delta"] = delta
        return self._expect(self._send("POST", "/v1/quote", body), QuoteResponse, 200)

    def quote_rounds(self, silo_id: int, runs: Sequence[tuple[AnyMechanism | Mapping[str, Any] | None, int]], *,
                     rounds: int, calibrate: bool = False) -> RoundsQuote:
        """A job's rounds for this silo, as (mechanism or None, count) runs in order, priced in one
        request: how many its remaining budget buys, read by its gate (and with calibrate, the σ for
        `rounds` of them)."""
        body = {"silo_id": silo_id, "rounds": rounds, "calibrate": calibrate, "runs": [
            {"mechanism": None if m is None else as_mechanism(m).model_dump(mode="json", exclude_none=True), "count": n}
            for m, n in runs
        ]}
        return self._expect(self._send("POST", "/v1/quote/rounds", body), RoundsQuote, 200)

    def calibrate(self, *, epsilon: float, delta: float, sampling_rate: float, steps: int) -> float:
        body = {"epsilon": epsilon, "delta": delta, "sampling_rate": sampling_rate, "steps": steps}
        return self._expect(self._send("POST", "/v1/calibrate", body), CalibrateResponse, 200).noise_multiplier

    # --- readers: the people and audit commands ---------------------------------------------------
    def silos(self) -> list[SiloSummary]:
        """Every silo the key may see, with its budget and ε spent (GET /v1/silos)."""
        return _SILOS.validate_json(self._send("GET", "/v1/silos").expect(200).content)

    def charges(self, silo_id: int, *, status: ChargeStatus | None = None) -> list[ChargeReserved]:
        """A silo's charges as they stand, or only those of one status (reserved: the open ones)."""
        params = None if status is None else {"status": status.value}
        return _CHARGES.validate_json(self._send("GET", f"/v1/silos/{silo_id}/charges", params=params).expect(200).content)

    def verify_chain(self) -> VerifyResponse:
        """The ledger recomputes every hash of its chain (GET /v1/audit/verify)."""
        return self._expect(self._send("GET", "/v1/audit/verify"), VerifyResponse, 200)

    def log_public_key(self) -> PublicKey:
        """The Ed25519 key that signs the transparency log's tree heads."""
        return self._expect(self._send("GET", "/v1/log/public-key"), PublicKey, 200)

    def log_head(self) -> SignedTreeHead:
        return self._expect(self._send("GET", "/v1/log/head"), SignedTreeHead, 200)

    def log_leaves(self, *, start: int, limit: int, silo_id: int | None = None) -> list[LogLeaf]:
        """The log's leaves from `start` (only `silo_id`'s, when given), each with the record behind it."""
        params: dict[str, Any] = {"start": start, "limit": limit}
        if silo_id is not None:
            params["silo_id"] = silo_id
        return _LEAVES.validate_json(self._send("GET", "/v1/log/leaves", params=params).expect(200).content)

    def log_proofs(self, *, size: int, inclusion: Sequence[int], consistency: Sequence[int]) -> LogProofs:
        """Inclusion paths of `inclusion` and consistency paths from `consistency`, to the tree of `size`."""
        params = {"size": size, "inclusion": ",".join(map(str, inclusion)), "consistency": ",".join(map(str, consistency))}
        return self._expect(self._send("GET", "/v1/log/proofs", params=params), LogProofs, 200)

    def log_inclusion(self, leaf_hash: str, *, size: int | None = None, wait_until: float | None = None
                      ) -> InclusionProof | None:
        """Where the leaf `leaf_hash` sits in the log (RFC 6962's get-proof-by-hash), or None while it
        is not sequenced. `wait_until` (seconds since the epoch, e.g. a receipt's promised deadline):
        ask again until then, every 100 ms; a leaf still missing at its deadline is a broken promise."""
        params: dict[str, Any] = {"leaf_hash": leaf_hash} if size is None else {"leaf_hash": leaf_hash, "size": size}
        while True:
            answer = self._send("GET", "/v1/log/proofs/by-hash", params=params)
            if answer.response.status_code != 404:
                return self._expect(answer, InclusionProof, 200)
            if wait_until is None or time.time() >= wait_until:
                return None
            time.sleep(min(0.1, max(0.0, wait_until - time.time())))

    def included(self, receipt: Receipt) -> InclusionProof | None:
        """`log_inclusion` of a receipt's leaf, waiting at most until its promise's deadline."""
        deadline = None if receipt.promise is None else receipt.promise.deadline / 1000
        return self.log_inclusion(receipt.leaf_hash, wait_until=deadline)

    def complete(self, receipt: Receipt) -> Receipt | None:
        """The receipt with its inclusion: the log's current signed head and the path to it, once the
        sequencer has the leaf (waiting at most until the promised deadline); None if it does not."""
        if receipt.included:
            return receipt
        if self.included(receipt) is None:
            return None
        head = self.log_head()  # then the path to that very head: the log may grow in between
        proof = self.log_inclusion(receipt.leaf_hash, size=head.tree_size)
        if proof is None:
            return None
        return receipt.model_copy(update={"log_index": proof.log_index, "tree_head": head, "inclusion_path": proof.path})

    def record_verified(self, head: SignedTreeHead) -> SignedTreeHead:
        """Tells the ledger (its dashboard) that this auditor verified `head`."""
        return self._expect(self._send("POST", "/v1/log/verified", head), SignedTreeHead, 201)

    def read(self, path: str, params: Mapping[str, Any] | None = None) -> Any:
        """A GET's JSON body, unparsed, with this client's errors: the transparency checker's one seam
        (path → JSON, see `dpledger.audit.outcome.Get`), which validates each answer into
        the wire's models itself, so that its tests can drive it from an in-process app."""
        return self._send("GET", path, params=params).expect(200).json()
