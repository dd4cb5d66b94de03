"""The worker's only way to the ledger: a typed httpx client over the wire contract (`dpledger.wire`).

Requests are the wire's pydantic models (a mechanism given as a plain mapping is validated into one
before it is sent); answers are parsed into the wire's response models. Errors form one tree:

- `Denied`: over budget. Final, never retried; carries the refusal's numbers.
- `Rejected`: any other 4xx (bad request, wrong key, a conflict): a bug or a policy on our side,
  never retried.
- `Unreachable`: connection errors, timeouts and 5xx, retried with exponential backoff up to a bound;
  then the caller stops without spending more.

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

import math
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from dpledger.wire.enums import ChargeStatus, Role
from dpledger.wire.mechanisms import AnyMechanism, Mechanism
from dpledger.wire.receipts import Receipt, default_receipts_dir
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
)
from dpledger.wire.searches import DistributionKind, SearchDetail, SearchStarted

_MECHANISM: TypeAdapter[AnyMechanism] = TypeAdapter(Mechanism)
_HISTORY: TypeAdapter[list[HistoryEntry]] = TypeAdapter(list[HistoryEntry])
ModelT = TypeVar("ModelT", bound=BaseModel)
RECEIPTS_FILE = "receipts.jsonl"


class LedgerError(Exception):
    """Anything the ledger said or failed to say."""


class Denied(LedgerError):
    """Over budget: final. The silo stops spending."""

    def __init__(self, *, epsilon: float, epsilon_spent: float | None, epsilon_if_approved: float | None, detail: str) -> None:
        super().__init__(detail)
        self.epsilon = epsilon
        self.epsilon_spent = epsilon_spent
        self.epsilon_if_approved = epsilon_if_approved

    @classmethod
    def from_response(cls, refusal: OverBudgetResponse) -> Denied:
        return cls(epsilon=refusal.epsilon, epsilon_spent=refusal.epsilon_spent,
                   epsilon_if_approved=refusal.epsilon_if_approved, detail=refusal.detail)


class Rejected(LedgerError):
    """A 4xx other than a denial (bad request, wrong key, conflict): never retried."""

    def __init__(self, status_code: int, body: Any) -> None:
        super().__init__(f"{status_code}: {body}")
        self.status_code = status_code
        self.body = body


class Unreachable(LedgerError):
    """The service did not answer within the retry bound: stop without spending."""


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


@dataclass(frozen=True)
class _Answer:
    response: httpx.Response


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
        keep the ledger's receipts in (one JSON line each), True for `default_receipts_dir()`,
        False for none."""
        self._owns_http = http is None
        self._http = http if http is not None else httpx.Client(base_url=base_url, transport=transport, timeout=timeout)
        self._headers = {"Authorization": f"Bearer {api_key}"}
        # Read here, not at import: $DPLEDGER_RETRY_WINDOW may be set after the module was imported.
        self._retry = retry if retry is not None else Retry()
        self.receipts_file = None if receipts is False else (
            (default_receipts_dir() if receipts is True else Path(receipts)) / RECEIPTS_FILE
        )

    def _keep(self, receipt: Receipt | None) -> None:
        # Appended before the answer is used: a receipt is the silo's evidence against the ledger.
        if receipt is None or self.receipts_file is None:
            return
        self.receipts_file.parent.mkdir(parents=True, exist_ok=True)
        with self.receipts_file.open("a") as out:
            out.write(receipt.model_dump_json() + "\n")

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> LedgerClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # --- transport --------------------------------------------------------------------------------
    def _send(self, method: str, path: str, body: BaseModel | Mapping[str, Any] | None = None) -> _Answer:
        payload = body.model_dump(mode="json", exclude_none=True) if isinstance(body, BaseModel) else body
        delay, attempts = self._retry.first_delay, 0
        deadline = time.monotonic() + self._retry.window
        while True:
            attempts += 1
            try:
                response = self._http.request(method, path, json=payload, headers=self._headers)
            except httpx.TransportError as error:
                failure: str = f"{type(error).__name__}: {error}"
            else:
                if response.status_code < 500:
                    return _Answer(response)
                failure = f"HTTP {response.status_code}"
            if time.monotonic() + delay > deadline:
                raise Unreachable(
                    f"{method} {path} failed {attempts} times in {self._retry.window:g} s; last: {failure}"
                )
            time.sleep(delay)
            delay = min(delay * self._retry.factor, self._retry.max_delay)

    @staticmethod
    def _body(response: httpx.Response) -> Any:
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.json()
        return response.text

    def _expect(self, answer: _Answer, model: type[ModelT], *ok: int) -> ModelT:
        response = answer.response
        if response.status_code not in ok:
            raise Rejected(response.status_code, self._body(response))
        return model.model_validate_json(response.content)

    def _denied_or_rejected(self, response: httpx.Response) -> LedgerError:
        """A 409 is a denial when it carries the refusal's numbers, else a conflict (Rejected)."""
        body = self._body(response)
        if response.status_code == 409:
            try:
                return Denied.from_response(OverBudgetResponse.model_validate(body))
            except ValidationError:
                pass
        return Rejected(response.status_code, body)

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
        response = self._send("DELETE", f"/v1/keys/{key_id}").response
        if response.status_code != 204:
            raise Rejected(response.status_code, self._body(response))

    # --- a silo's own ------------------------------------------------------------------------------
    def silo(self, silo_id: int) -> SiloDetail:
        return self._expect(self._send("GET", f"/v1/silos/{silo_id}"), SiloDetail, 200)

    def history(self, silo_id: int) -> list[HistoryEntry]:
        answer = self._send("GET", f"/v1/silos/{silo_id}/history")
        if answer.response.status_code != 200:
            raise Rejected(answer.response.status_code, self._body(answer.response))
        return _HISTORY.validate_json(answer.response.content)

    def reserve(self, silo_id: int, *, mechanism: AnyMechanism | Mapping[str, Any], idempotency_key: str,
                job_id: str | None = None, round: int | None = None) -> Reservation:
        attempt_id = secrets.token_urlsafe(16)  # this call's, reused by its own retries in _send
        body = {"mechanism": as_mechanism(mechanism).model_dump(mode="json", exclude_none=True),
                "idempotency_key": idempotency_key, "job_id": job_id, "round": round, "attempt_id": attempt_id}
        answer = self._send("POST", f"/v1/silos/{silo_id}/charges", body)
        response = answer.response
        if response.status_code not in (200, 201):
            raise self._denied_or_rejected(response)
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

    def _settle(self, charge_id: int, action: str, *, done: ChargeStatus) -> float | None:
        """The silo's ε after the settlement, or None when an earlier attempt had landed already."""
        response = self._send("POST", f"/v1/charges/{charge_id}/{action}").response
        if response.status_code == 409:
            body = self._body(response)
            if isinstance(body, dict) and body.get("charge_status") == done.value:
                return None  # an earlier attempt landed and only its answer was lost
            raise Rejected(409, body)
        if response.status_code != 200:
            raise Rejected(response.status_code, self._body(response))
        settled = ChargeSettled.model_validate_json(response.content)
        self._keep(settled.receipt)
        return settled.epsilon_spent

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
        response = self._send("POST", f"/v1/silos/{silo_id}/searches", body).response
        if response.status_code != 201:
            raise self._denied_or_rejected(response)
        started = SearchStarted.model_validate_json(response.content)
        self._keep(started.receipt)
        return started

    def report_trial(self, search_id: int, *, score: float) -> SearchDetail:
        return self._expect(self._send("POST", f"/v1/searches/{search_id}/trials", {"score": score}), SearchDetail, 200)

    # --- jobs, norms and groups (the coordinator's side) -------------------------------------------
    def create_job(self, *, name: str, silo_ids: list[int]) -> int:
        return self._expect(self._send("POST", "/v1/jobs", {"name": name, "silo_ids": silo_ids}), JobCreated, 201).job_id

    def report_norm(self, job_id: int, round: int, *, silo_id: int, l2_norm: float) -> None:
        answer = self._send("POST", f"/v1/jobs/{job_id}/rounds/{round}/norms", {"silo_id": silo_id, "l2_norm": l2_norm})
        if answer.response.status_code != 201:
            raise Rejected(answer.response.status_code, self._body(answer.response))

    def groups(self, job_id: int, round: int) -> dict[int, int]:
        """Silo id → privacy group (0 = least noisy), from the norms alone."""
        return self._expect(self._send("GET", f"/v1/jobs/{job_id}/rounds/{round}/groups"), GroupsResponse, 200).groups

    # --- anyone ------------------------------------------------------------------------------------
    def who_am_i(self) -> KeyInfo:
        """The key's id, role and silo (GET /v1/keys/me)."""
        return self._expect(self._send("GET", "/v1/keys/me"), KeyInfo, 200)

    def history_page(self, silo_id: int, *, after_seq: int, limit: int) -> list[HistoryEntry]:
        answer = self._send("GET", f"/v1/silos/{silo_id}/history?after_seq={after_seq}&limit={limit}")
        if answer.response.status_code != 200:
            raise Rejected(answer.response.status_code, self._body(answer.response))
        return _HISTORY.validate_json(answer.response.content)

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
