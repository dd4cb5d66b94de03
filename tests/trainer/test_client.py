"""The worker's client against a real uvicorn: denials are final, outages are retried, then stop."""

from __future__ import annotations

import time

import httpx
import pytest
from pydantic import ValidationError

from dpledger.harness import free_port, running_server
from dpledger.wire.client import RETRY_WINDOW_ENV, LedgerClient, Retry
from dpledger.wire.enums import ChargeStatus
from dpledger.wire.errors import Denied, Rejected, Unreachable
from dpledger.wire.mechanisms import DpSgd
from dpledger.wire.schemas import SiloDetail
from tests.conftest import ADMIN_KEY

STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.0, "steps": 1}


class CountingTransport(httpx.HTTPTransport):
    """A real transport that first drops `fail_first` requests on the floor, and counts them all."""

    def __init__(self, fail_first: int = 0) -> None:
        super().__init__()
        self.fail_first = fail_first
        self.calls = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        if self.calls <= self.fail_first:
            raise httpx.ConnectError("dropped by the test", request=request)
        return super().handle_request(request)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> str:  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path_factory.mktemp('client')}/ledger.db"
    with running_server(database_url=url, admin_key=ADMIN_KEY) as base:
        yield base


@pytest.fixture
def silo(server: str):  # type: ignore[no-untyped-def]
    with LedgerClient(server, ADMIN_KEY) as admin:
        created = admin.create_silo(name=f"s-{free_port()}", epsilon=1.0, delta=1e-5, dataset_size=1000)
    return created


def test_a_denial_is_final_and_sent_once(server: str, silo) -> None:  # type: ignore[no-untyped-def]
    transport = CountingTransport()
    with LedgerClient(server, silo.api_key, transport=transport) as client:
        with pytest.raises(Denied) as denied:
            client.reserve(silo.id, mechanism={**STEP, "steps": 10_000}, idempotency_key="big")
    assert transport.calls == 1
    assert denied.value.epsilon == 1.0 and denied.value.epsilon_if_approved > 1.0


def test_dropped_requests_are_retried_and_charge_once(server: str, silo) -> None:  # type: ignore[no-untyped-def]
    transport = CountingTransport(fail_first=2)
    with LedgerClient(server, silo.api_key, transport=transport, retry=Retry(first_delay=0.01)) as client:
        reservation = client.reserve(silo.id, mechanism=STEP, idempotency_key="r1")
        again = client.reserve(silo.id, mechanism=STEP, idempotency_key="r1")  # a retry after a lost answer
        assert again.charge_id == reservation.charge_id and again.replayed and not again.owned
        assert reservation.owned and not reservation.replayed  # the lost attempts never landed
        assert client.commit(reservation.charge_id) == pytest.approx(reservation.epsilon_spent)
        assert client.commit(reservation.charge_id) is None  # the second attempt sees it done
        assert client.silo(silo.id).epsilon_spent == pytest.approx(reservation.epsilon_spent)
        assert transport.calls == 2 + 5  # (closing then completes the kept receipts: requests of their own)


def test_an_unreachable_service_stops_after_the_bound(silo) -> None:  # type: ignore[no-untyped-def]
    dead = f"http://127.0.0.1:{free_port()}"
    with LedgerClient(dead, silo.api_key, retry=Retry(window=0.5, first_delay=0.1, factor=2.0)) as client:
        started = time.monotonic()
        with pytest.raises(Unreachable, match=r"failed 3 times in 0.5 s"):  # at 0, 0.1 and 0.3 s; 0.7 is past the window
            client.reserve(silo.id, mechanism=STEP, idempotency_key="x")
        assert time.monotonic() - started < 0.5


def test_the_retry_window_defaults_to_a_minute_and_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RETRY_WINDOW_ENV, raising=False)
    assert Retry().window == 60.0
    monkeypatch.setenv(RETRY_WINDOW_ENV, "90")
    assert Retry().window == 90.0
    with LedgerClient("http://127.0.0.1:1", "key", receipts=False) as client:  # read when the client is made
        assert client._retry.window == 90.0
    monkeypatch.setenv(RETRY_WINDOW_ENV, "soon")
    with pytest.raises(ValueError, match=RETRY_WINDOW_ENV):
        Retry()


def test_a_malformed_mechanism_never_leaves_the_worker(server: str, silo) -> None:  # type: ignore[no-untyped-def]
    transport = CountingTransport()
    with LedgerClient(server, silo.api_key, transport=transport) as client:
        with pytest.raises(ValidationError, match="noise_multiplier"):
            client.reserve(silo.id, mechanism={"type": "gaussian", "noise_multiplier": -1}, idempotency_key="bad")
    assert transport.calls == 0


def test_a_bad_request_is_rejected_not_retried(server: str, silo) -> None:  # type: ignore[no-untyped-def]
    transport = CountingTransport()
    with LedgerClient(server, silo.api_key, transport=transport) as client:
        with pytest.raises(Rejected) as rejected:  # well-formed, but larger than the registered 1000 records
            client.reserve(silo.id, mechanism={**STEP, "batch_size": 5000}, idempotency_key="bad")
    assert rejected.value.status_code == 422 and "batch_size" in str(rejected.value.body) and transport.calls == 1
    assert (rejected.value.method, rejected.value.path) == ("POST", f"/v1/silos/{silo.id}/charges")


class FailingTransport(httpx.BaseTransport):
    """Answers every request with a 503 and a JSON reason, as a proxy in front of a dead ledger does."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"detail": "ledger restarting"})


def test_a_5xx_after_the_bound_carries_its_status_body_and_path() -> None:
    with LedgerClient("http://ledger", "key", transport=FailingTransport(), retry=Retry(window=0), receipts=False) as client:
        with pytest.raises(Unreachable) as unreachable:
            client.silo(7)
    error = unreachable.value
    assert (error.status_code, error.body, error.path) == (503, {"detail": "ledger restarting"}, "/v1/silos/7")
    assert error.last == "HTTP 503"


def test_the_readers_answer_the_wire_models(server: str, silo) -> None:  # type: ignore[no-untyped-def]
    """The people and audit commands' reads, typed: the same numbers as the silo's own view."""
    with LedgerClient(server, silo.api_key, receipts=False) as client:
        first = client.reserve(silo.id, mechanism=STEP, idempotency_key="read-0", job_id="j", round=0)
        second = client.reserve(silo.id, mechanism=STEP, idempotency_key="read-1", job_id="j", round=1)
        client.commit(first.charge_id)
    with LedgerClient(server, ADMIN_KEY, receipts=False) as admin:
        (listed,) = [s for s in admin.silos() if s.id == silo.id]
        assert listed.epsilon_spent == admin.silo(silo.id).epsilon_spent == second.epsilon_spent
        charges = admin.charges(silo.id)
        assert [(c.charge_id, c.status) for c in charges] == [
            (first.charge_id, ChargeStatus.committed), (second.charge_id, ChargeStatus.reserved)]
        assert [c.charge_id for c in admin.charges(silo.id, status=ChargeStatus.reserved)] == [second.charge_id]
        settled = admin.settle_charge(second.charge_id, "release")
        assert (settled.charge_id, settled.status) == (second.charge_id, ChargeStatus.released)
        with pytest.raises(Rejected) as again:  # a person sees the refusal itself, not a quiet None
            admin.settle_charge(second.charge_id, "release")
        assert again.value.status_code == 409 and again.value.body["charge_status"] == "released"
        assert admin.release(second.charge_id) is None  # the worker's settle: an earlier attempt landed
        history = admin.history_page(silo.id, after_seq=0, limit=100)
        csv_rows = admin.history_csv_page(silo.id, after_seq=0, limit=100).splitlines()
        assert len(csv_rows) == 1 + len(history) and csv_rows[-1].startswith(f"{history[-1].seq},")
        assert [e.seq for e in admin.history_page(silo.id, after_seq=history[0].seq, limit=1)] == [history[1].seq]
        assert admin.verify_chain().ok
        # The silo's leaves, once the sequencer has given them indices (0.1–1 s after an approval),
        # then the head: a batch may come between the two reads, and the tree only grows, so every
        # leaf read first lies inside the head read after it.
        deadline = time.monotonic() + 30
        while not (leaves := admin.log_leaves(start=0, limit=1000, silo_id=silo.id)) and time.monotonic() < deadline:
            time.sleep(0.05)
        head, key = admin.log_head(), admin.log_public_key()
        assert leaves and all(leaf.log_index < head.tree_size for leaf in leaves)
        proofs = admin.log_proofs(size=head.tree_size, inclusion=[leaves[0].log_index], consistency=[])
        assert [p.log_index for p in proofs.inclusion] == [leaves[0].log_index]
        assert admin.record_verified(head) == head and key.key_id == head.key_id


def test_a_reservation_says_whether_it_is_owned(server: str, silo) -> None:  # type: ignore[no-untyped-def]
    with LedgerClient(server, silo.api_key) as client:
        first = client.reserve(silo.id, mechanism=DpSgd(batch_size=10, noise_multiplier=1.0, steps=1), idempotency_key="f")
        assert first.owned and not first.replayed and first.attempt_id == first.own_attempt_id
        again = client.reserve(silo.id, mechanism=STEP, idempotency_key="f")  # a second call, not a retry of the first
        assert again.charge_id == first.charge_id and again.replayed and not again.owned
        assert again.attempt_id == first.attempt_id != again.own_attempt_id
        assert isinstance(client.silo(silo.id), SiloDetail)


class LosesFirstAnswer(httpx.HTTPTransport):
    """A real transport that delivers the first request to the server, then drops its answer."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        response = super().handle_request(request)
        if self.calls == 1:
            response.read()
            raise httpx.ReadError("answer lost by the test", request=request)
        return response


def test_a_replay_that_answers_the_calls_own_lost_attempt_is_owned(server: str, silo) -> None:  # type: ignore[no-untyped-def]
    transport = LosesFirstAnswer()
    with LedgerClient(server, silo.api_key, transport=transport, retry=Retry(first_delay=0.01)) as client:
        reservation = client.reserve(silo.id, mechanism=STEP, idempotency_key="lost")
        assert transport.calls == 2  # (closing then completes the kept receipt: requests of their own)
    assert reservation.replayed and reservation.owned


def test_a_redelivery_whose_answer_is_lost_does_not_own_an_earlier_reservation(server: str, silo) -> None:  # type: ignore[no-untyped-def]
    """The issue's sequence: delivery 1 reserves and dies before settling; delivery 2's first answer
    (a replay) is lost and its retry gets the replay again. Under the old rule ("a replay after my own
    retry is mine") delivery 2 trained a second time on one charge."""
    with LedgerClient(server, silo.api_key) as first_delivery:
        held = first_delivery.reserve(silo.id, mechanism=STEP, idempotency_key="redelivered")
    assert held.owned
    transport = LosesFirstAnswer()
    with LedgerClient(server, silo.api_key, transport=transport, retry=Retry(first_delay=0.01)) as second_delivery:
        replay = second_delivery.reserve(silo.id, mechanism=STEP, idempotency_key="redelivered")
        calls = transport.calls  # before closing completes the kept receipts
    assert calls == 2 and replay.replayed and replay.charge_id == held.charge_id
    assert replay.attempt_id == held.own_attempt_id and not replay.owned


def test_a_429_is_retried_after_its_retry_after(server: str, silo) -> None:  # type: ignore[no-untyped-def]
    """A key holds one request in flight on the routes that compute; the client's second, sent while
    the first runs, is told 429 with Retry-After and is sent again, not raised."""
    import threading

    heavy = {"type": "dpsgd", "sampling_rate": 0.999, "noise_multiplier": 0.5}
    transports = [CountingTransport(), CountingTransport()]
    answers: list[float] = []
    together = threading.Barrier(2)

    def quote(i: int) -> None:
        with LedgerClient(server, silo.api_key, transport=transports[i], receipts=False) as client:
            together.wait()
            answers.append(client.quote({**heavy, "steps": 70 + i}, delta=1e-5).epsilon)

    threads = [threading.Thread(target=quote, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == 2 and all(eps > 0 for eps in answers)
    assert sum(t.calls for t in transports) >= 3  # one of the two met the other in flight at least once
