"""The worker's only way to the ledger: an httpx client with a typed error tree (STYLE.md, httpx).

A denial is final and never retried. An unreachable service (connection errors, timeouts, 5xx) is
retried with exponential backoff; after the bound the run stops without spending. Retrying a
reservation is safe because it carries an idempotency key; retrying a commit is made safe by the
service's machine-readable `charge_status` on a second settlement.

Only a fresh reservation lets a round touch the data (`Reservation.fresh`): a 201, or the replay
(200, `replayed`) that answers this very call's own retry after its first attempt got no answer.
Any other replay names a charge some earlier call already holds (reserved, committed or released).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import httpx


class LedgerError(Exception):
    """Anything the ledger said or failed to say."""


class Denied(LedgerError):
    """Over budget: final. The silo stops spending."""

    def __init__(self, *, epsilon: float, epsilon_spent: float | None, epsilon_if_approved: float | None, detail: str) -> None:
        super().__init__(detail)
        self.epsilon = epsilon
        self.epsilon_spent = epsilon_spent
        self.epsilon_if_approved = epsilon_if_approved


class Rejected(LedgerError):
    """A 4xx other than a denial (bad request, wrong key): a bug on our side, never retried."""

    def __init__(self, status_code: int, body: Any) -> None:
        super().__init__(f"{status_code}: {body}")
        self.status_code = status_code
        self.body = body


class Unreachable(LedgerError):
    """The service did not answer within the retry bound: stop without spending."""


@dataclass(frozen=True)
class Reservation:
    charge_id: int
    epsilon_spent: float
    epsilon_remaining: float
    status: str = "reserved"  # the charge's real state: reserved, committed or released
    replayed: bool = False  # the idempotency key was seen before this call's first attempt landed
    own_retry: bool = False  # this call retried after an attempt that got no answer

    @property
    def fresh(self) -> bool:
        """A new approval this call may spend: never a replay of a charge settled or held elsewhere."""
        return self.status == "reserved" and (not self.replayed or self.own_retry)


@dataclass(frozen=True)
class Retry:
    attempts: int = 6
    first_delay: float = 0.2
    factor: float = 2.0


class LedgerClient:
    def __init__(self, base_url: str, api_key: str, *, transport: httpx.BaseTransport | None = None,
                 retry: Retry = Retry(), timeout: float = 30.0) -> None:
        self._http = httpx.Client(
            base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, transport=transport, timeout=timeout
        )
        self._retry = retry

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> LedgerClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _send(self, method: str, path: str, json: Any = None) -> httpx.Response:
        return self._send_counting(method, path, json)[0]

    def _send_counting(self, method: str, path: str, json: Any = None) -> tuple[httpx.Response, int]:
        """The answer, and how many attempts before it got none (a transport error or a 5xx)."""
        delay = self._retry.first_delay
        for attempt in range(self._retry.attempts):
            try:
                response = self._http.request(method, path, json=json)
            except httpx.TransportError as error:
                failure: str = f"{type(error).__name__}: {error}"
            else:
                if response.status_code < 500:
                    return response, attempt
                failure = f"HTTP {response.status_code}"
            if attempt + 1 < self._retry.attempts:
                time.sleep(delay)
                delay *= self._retry.factor
        raise Unreachable(f"{method} {path} failed {self._retry.attempts} times; last: {failure}")

    def _json(self, response: httpx.Response, *ok: int) -> Any:
        if response.status_code in ok:
            return response.json() if response.content else None
        body = response.json() if response.headers.get("content-type", "").startswith("application/json") else response.text
        raise Rejected(response.status_code, body)

    # --- admin -----------------------------------------------------------------------------------
    def create_silo(self, *, name: str, epsilon: float, delta: float, dataset_size: int) -> dict[str, Any]:
        body = {"name": name, "epsilon": epsilon, "delta": delta, "dataset_size": dataset_size}
        return self._json(self._send("POST", "/v1/silos", body), 201)  # type: ignore[no-any-return]

    # --- a silo's own ------------------------------------------------------------------------------
    def silo(self, silo_id: int) -> dict[str, Any]:
        return self._json(self._send("GET", f"/v1/silos/{silo_id}"), 200)  # type: ignore[no-any-return]

    def history(self, silo_id: int) -> list[dict[str, Any]]:
        return self._json(self._send("GET", f"/v1/silos/{silo_id}/history"), 200)  # type: ignore[no-any-return]

    def reserve(self, silo_id: int, *, mechanism: dict[str, Any], idempotency_key: str,
                job_id: str | None = None, round: int | None = None) -> Reservation:
        body = {"mechanism": mechanism, "idempotency_key": idempotency_key, "job_id": job_id, "round": round}
        response, failed_attempts = self._send_counting("POST", f"/v1/silos/{silo_id}/charges", body)
        if response.status_code == 409:
            data = response.json()
            raise Denied(epsilon=data["epsilon"], epsilon_spent=data["epsilon_spent"],
                         epsilon_if_approved=data["epsilon_if_approved"], detail=data["detail"])
        data = self._json(response, 201, 200)
        return Reservation(
            data["charge_id"], data["epsilon_spent"], data["epsilon_remaining"], status=data["status"],
            replayed=response.status_code == 200 or bool(data["replayed"]), own_retry=failed_attempts > 0,
        )

    def charges(self, silo_id: int, *, job_id: str | None = None, status: str | None = None) -> list[dict[str, Any]]:
        """The silo's charges (e.g. of one job), as the ledger holds them."""
        params = {k: v for k, v in (("job_id", job_id), ("status", status)) if v is not None}
        query = f"?{urlencode(params)}" if params else ""
        return self._json(self._send("GET", f"/v1/silos/{silo_id}/charges{query}"), 200)  # type: ignore[no-any-return]

    def commit(self, charge_id: int) -> float | None:
        return self._settle(charge_id, "commit", done="committed")

    def release(self, charge_id: int) -> float | None:
        return self._settle(charge_id, "release", done="released")

    def _settle(self, charge_id: int, action: str, *, done: str) -> float | None:
        response = self._send("POST", f"/v1/charges/{charge_id}/{action}")
        if response.status_code == 409 and response.json().get("charge_status") == done:
            return None  # an earlier attempt landed and only its answer was lost
        return self._json(response, 200)["epsilon_spent"]  # type: ignore[no-any-return]

    # --- jobs, norms and groups (the coordinator's side) -------------------------------------------
    def create_job(self, *, name: str, silo_ids: list[int]) -> int:
        return int(self._json(self._send("POST", "/v1/jobs", {"name": name, "silo_ids": silo_ids}), 201)["job_id"])

    def report_norm(self, job_id: int, round: int, *, silo_id: int, l2_norm: float) -> None:
        self._json(self._send("POST", f"/v1/jobs/{job_id}/rounds/{round}/norms", {"silo_id": silo_id, "l2_norm": l2_norm}), 201)

    def groups(self, job_id: int, round: int) -> dict[int, int]:
        """Silo id → privacy group (0 = least noisy), from the norms alone."""
        body = self._json(self._send("GET", f"/v1/jobs/{job_id}/rounds/{round}/groups"), 200)
        return {int(silo): group for silo, group in body["groups"].items()}

    # --- anyone ------------------------------------------------------------------------------------
    def calibrate(self, *, epsilon: float, delta: float, sampling_rate: float, steps: int) -> float:
        body = {"epsilon": epsilon, "delta": delta, "sampling_rate": sampling_rate, "steps": steps}
        return float(self._json(self._send("POST", "/v1/calibrate", body), 200)["noise_multiplier"])
