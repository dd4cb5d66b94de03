"""Issue 13, item 7: no request may cost the server more than ~2 s of CPU or 1 GB of memory. A real
`python -m dpledger.service.serving` process on 127.0.0.1; its memory is read from
/proc/PID/status (VmHWM: the peak resident set since it started) and its CPU from /proc/PID/stat."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from dpledger.harness import ServerProcess
from tests.conftest import ADMIN_KEY

GIB = 1024**3
LIMIT_S = 2.0
# The bound is on the server's CPU; wall time only catches a hang (a busy CI machine stretches it several times).
WALL_LIMIT_S = 30.0
pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    raise AssertionError("no VmHWM")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def leaf(i: int) -> dict:
    # 100 distinct Poisson-sampled leaves: each a new (q, σ) pair for dp-accounting.
    return {"type": "dpsgd", "batch_size": 10 + i, "noise_multiplier": 1.0 + i / 1000, "steps": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProcess:  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path_factory.mktemp('bounded')}/ledger.db"
    with ServerProcess(database_url=url, admin_key=ADMIN_KEY, workers=1) as process:
        yield process


def ask(server: ServerProcess, path: str, body: dict, key: str = ADMIN_KEY) -> tuple[httpx.Response, float, float]:
    assert server.process is not None
    pid = server.process.pid
    cpu_before, started = cpu_seconds(pid), time.perf_counter()
    response = httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    return response, time.perf_counter() - started, cpu_seconds(pid) - cpu_before


def test_the_issues_two_requests_answer_a_4xx_within_2_s_under_1_gb(server: ServerProcess) -> None:
    silo = httpx.post(f"{server.url}/v1/silos", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, json={
        "name": "bounded", "epsilon": 1000.0, "delta": 1e-5, "dataset_size": 10_000}).json()
    cases = [
        ("/v1/quote", {"mechanism": {"type": "gaussian", "noise_multiplier": 0.001}, "delta": 1e-5}, ADMIN_KEY,
         ["body", "mechanism", "noise_multiplier"]),
        (f"/v1/silos/{silo['id']}/charges", {"mechanism": {"type": "composed", "events": [leaf(i) for i in range(100)]},
                                             "idempotency_key": "wide"}, silo["api_key"], ["body", "mechanism"]),
    ]
    for path, body, key, where in cases:
        response, wall, cpu = ask(server, path, body, key)
        assert response.status_code == 422, response.text
        assert response.json()["detail"][0]["loc"] == where
        assert wall < WALL_LIMIT_S and cpu < LIMIT_S, (path, wall, cpu)
    assert server.process is not None
    assert peak_rss_bytes(server.process.pid) < GIB


@pytest.mark.parametrize(
    "mechanism",
    [
        {"type": "poisson_sampled", "sampling_rate": 0.5, "event": {"type": "gaussian", "noise_multiplier": 0.02}},
        {"type": "self_composed", "count": 10**5, "event": {"type": "laplace", "noise_multiplier": 2.5}},
        {"type": "self_composed", "count": 10**6, "event": {"type": "laplace", "noise_multiplier": 2.5}},
        {"type": "self_composed", "count": 10**7, "event": {"type": "self_composed", "count": 10**7,
                                                             "event": {"type": "gaussian", "noise_multiplier": 0.5}}},
        {"type": "gaussian", "noise_multiplier": 1e-5},
        {"type": "laplace", "noise_multiplier": 1e-3},
        {"type": "composed", "events": [
            {"type": "dpsgd", "sampling_rate": 0.01 + i / 1000, "noise_multiplier": 1.0, "steps": 10} for i in range(15)]},
    ],
    ids=["psg-sigma-0.02", "laplace-1e5", "laplace-1e6", "gaussian-1e14-times", "sigma-1e-5", "laplace-b-1e-3", "15-leaves"],
)
def test_what_was_seen_costing_seconds_or_gigabytes_answers_within_the_bound(server: ServerProcess, mechanism: dict) -> None:
    response, wall, cpu = ask(server, "/v1/quote", {"mechanism": mechanism, "delta": 1e-5})
    assert response.status_code in (200, 422), response.text  # never a 500
    if response.status_code == 200 and response.json()["epsilon_pld"] is None:
        assert response.json()["pld_note"]  # a skipped PLD report says why
    assert wall < WALL_LIMIT_S and cpu < LIMIT_S, (wall, cpu)
    assert server.process is not None
    assert peak_rss_bytes(server.process.pid) < GIB


# --- issue 26: the requests that escaped the bound, each within 2 s of server CPU and < 256 MB of growth ---

MIB = 1024**2
GROWTH = 256 * MIB


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def admin_silo(server: ServerProcess, name: str, **extra: object) -> httpx.Response:
    body = {"name": name, "epsilon": 1000.0, "delta": 1e-5, "dataset_size": 10_000, **extra}
    return httpx.post(f"{server.url}/v1/silos", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, json=body, timeout=60)


def test_a_quote_of_400_gaussians_answers_within_2_s_and_256_mb(server: ServerProcess) -> None:
    # Was 7.8–9.8 s and +570 MB: the plan's PLD of σ 2/√400 = 0.1 at 1e-4 (2.95M grid points).
    assert server.process is not None
    before = rss_bytes(server.process.pid)
    mechanism = {"type": "self_composed", "count": 400, "event": {"type": "gaussian", "noise_multiplier": 2.0}}
    response, wall, cpu = ask(server, "/v1/quote", {"mechanism": mechanism, "delta": 1e-5})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["epsilon"] > 0 and answer["epsilon_pld"] is not None  # the report at 1e-3: 295k points
    assert answer["epsilon_plan"] is None and "2.95e+06 points" in answer["plan_note"]
    assert cpu < LIMIT_S and wall < WALL_LIMIT_S, (wall, cpu)
    assert peak_rss_bytes(server.process.pid) - before < GROWTH


def test_the_same_as_a_plan_is_refused_with_a_422_naming_the_mechanism(server: ServerProcess) -> None:
    # Was a 409 after 7.4 s.
    silo = admin_silo(server, "plan400").json()
    mechanism = {"type": "self_composed", "count": 400, "event": {"type": "gaussian", "noise_multiplier": 2.0}}
    response, wall, cpu = ask(server, f"/v1/silos/{silo['id']}/plan", {"mechanism": mechanism}, silo["api_key"])
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "mechanism"]
    assert "grid of 2.95e+06 points" in response.json()["detail"][0]["msg"]
    assert cpu < LIMIT_S and wall < WALL_LIMIT_S, (wall, cpu)


@pytest.mark.parametrize(("sigma", "status"), [(1e-9, 422), (1e9, 422), (1.0, 201)])
def test_a_horizon_at_an_extreme_sigma_answers_within_2_s(server: ServerProcess, sigma: float, status: int) -> None:
    # Was 6–21 s (1e-9 then a 500: a ZeroDivisionError in the filter's allocation).
    assert server.process is not None
    pid, before = server.process.pid, rss_bytes(server.process.pid)
    horizon = {"type": "dpsgd", "batch_size": 100, "noise_multiplier": sigma, "steps": 100}
    cpu_before = cpu_seconds(pid)
    response = admin_silo(server, f"horizon-{sigma}", horizon=horizon)
    cpu = cpu_seconds(pid) - cpu_before
    assert response.status_code == status, response.text
    if status == 422:
        assert response.json()["detail"][0]["loc"][:2] == ["body", "horizon"]
    assert cpu < LIMIT_S, cpu
    assert peak_rss_bytes(pid) - before < GROWTH


def test_a_plan_refuses_a_declared_sampling_rate_as_a_charge_does(server: ServerProcess) -> None:
    silo = admin_silo(server, "declared-rate").json()
    mechanism = {"type": "dpsgd", "sampling_rate": 0.5, "noise_multiplier": 1.0, "steps": 10}
    for path, body in ((f"/v1/silos/{silo['id']}/plan", {"mechanism": mechanism}),
                       (f"/v1/silos/{silo['id']}/charges", {"mechanism": mechanism, "idempotency_key": "rate"})):
        response, _, _ = ask(server, path, body, silo["api_key"])
        assert response.status_code == 422, response.text
        detail = response.json()["detail"][0]
        assert detail["loc"] == ["body", "mechanism", "sampling_rate"]
        assert "is not taken on a silo's charge" in detail["msg"]


def sampled_leaves(n: int) -> dict:
    return {"type": "composed", "events": [
        {"type": "dpsgd", "batch_size": 10 + i, "noise_multiplier": 1.0, "steps": 1} for i in range(n)]}


@pytest.mark.parametrize("where", ["charge", "quote", "plan", "horizon"])
def test_15_sampled_leaves_pass_and_16_are_refused_everywhere(server: ServerProcess, where: str) -> None:
    silo = admin_silo(server, f"leaves-{where}").json()
    for n, refused in ((15, False), (16, True)):
        if where == "horizon":
            response = admin_silo(server, f"leaves-h{n}", horizon=sampled_leaves(n))
            loc = ["body", "horizon"]
        else:
            paths = {"charge": f"/v1/silos/{silo['id']}/charges", "plan": f"/v1/silos/{silo['id']}/plan"}
            path = paths.get(where, "/v1/quote")
            body: dict = {"mechanism": sampled_leaves(n)}
            if where == "charge":
                body["idempotency_key"] = f"leaves-{n}"
            if where == "quote":
                body["silo_id"] = silo["id"]
            response, _, cpu = ask(server, path, body, silo["api_key"])
            assert cpu < LIMIT_S
            loc = ["body", "mechanism"]
        if refused:
            assert response.status_code == 422, response.text
            assert response.json()["detail"][0]["loc"] == loc
            assert "16 distinct sampled leaves; one request may hold at most 15" in response.json()["detail"][0]["msg"]
        elif where == "plan":  # 15 pass the leaf limit; a plan's PLD then prices at most 8 distinct leaves
            assert response.status_code == 422 and "more than 8 distinct leaves" in response.text, response.text
        else:
            assert response.status_code in (200, 201), response.text


def test_a_calibration_past_the_sigma_ceiling_is_refused_at_once(server: ServerProcess) -> None:
    """It took ~10 s of CPU (σ 1.6e7 found by walking a bracket up from 1): now one ε at σ = 10^4 says no."""
    body = {"epsilon": 1e-3, "delta": 1e-5, "sampling_rate": 0.5, "steps": 100_000}
    response, seconds, cpu = ask(server, "/v1/calibrate", body)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "epsilon"]
    assert "even σ=10000 gives ε=" in response.json()["detail"][0]["msg"]
    assert seconds < LIMIT_S and cpu < LIMIT_S


@pytest.mark.parametrize("route", ["/v1/calibrate", "silo"])
def test_a_sigma_search_is_stopped_at_its_cpu_bound(route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process, the bound set to 0: the first step of either search stops it with a 422 naming why."""
    from dpledger.service.accounting import rdp, reports
    from dpledger.service.accounting.events import MechanismError

    monkeypatch.setattr(reports, "MAX_CALIBRATION_SECONDS", 0.0)
    with pytest.raises(MechanismError) as refused:
        if route == "silo":
            reports.calibrate_remaining(rdp.zero_curve(), budget=3.0, sampling_rate=0.01, steps=100,
                                        epsilon_of=lambda curve: rdp.epsilon(curve, delta=1e-5)[0])
        else:
            reports.calibrate_dpsgd_noise(epsilon=3.0, delta=1e-5, sampling_rate=0.01, steps=100)
    assert refused.value.field == ("rounds" if route == "silo" else "epsilon")
    assert "σ search was stopped after 0 s of CPU" in refused.value.message


# --- issue 46: the requests that still escaped, each priced before any work and guarded while it runs ---


def test_the_issues_table_answers_within_2_s_of_server_cpu_or_a_fast_4xx(server: ServerProcess) -> None:
    """Were 31.2, 15.0, 13.3, 6.3, 5.6, 2.7 and 2.0 s of server CPU (and no answer at all for the last)."""
    from tests.service import hostile

    plain = admin_silo(server, "table").json()
    replace = admin_silo(server, "table-replace-one", relation="replace_one").json()
    keys = {"admin": ADMIN_KEY, "silo": plain["api_key"]}
    for name, path, body, who in hostile.table(plain["id"], replace["id"]):
        response, _, cpu = ask(server, path, body, keys[who])
        assert response.status_code in (200, 201, 413, 422), (name, response.text[:300])
        limit = 0.3 if response.status_code in (413, 422) else LIMIT_S  # a refusal in milliseconds (0.3: a busy box)
        assert cpu < limit, (name, cpu)


def test_a_key_holds_one_request_in_flight_on_routes_that_compute_and_gets_429_beyond(server: ServerProcess) -> None:
    import threading

    heavy = {"delta": 1e-5, "mechanism": {"type": "dpsgd", "sampling_rate": 0.999, "noise_multiplier": 0.5, "steps": 5}}
    answers: list[httpx.Response] = []

    def send(i: int) -> None:
        body = {**heavy, "mechanism": {**heavy["mechanism"], "steps": 50 + i}}
        answers.append(httpx.post(f"{server.url}/v1/quote", json=body, timeout=60,
                                  headers={"Authorization": f"Bearer {ADMIN_KEY}"}))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    codes = sorted(answer.status_code for answer in answers)
    assert set(codes) <= {200, 429} and codes.count(429) >= 4, codes  # 1 at a time; later ones may find the slot free
    refused = next(answer for answer in answers if answer.status_code == 429)
    assert refused.headers["Retry-After"] == "1" and "in flight" in refused.json()["detail"]


def test_a_body_larger_than_any_request_is_a_413_before_it_is_parsed(server: ServerProcess) -> None:
    response = httpx.post(f"{server.url}/v1/quote", content=b"[" * (2 * 1024 * 1024), timeout=60,
                          headers={"Authorization": f"Bearer {ADMIN_KEY}", "content-type": "application/json"})
    assert response.status_code == 413 and "larger than 1048576 bytes" in response.text


def test_a_computation_that_outruns_its_price_is_stopped_at_the_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process: leaves sampled without replacement priced as if they were free. The first leaf's
    curve outruns the request's whole allowance (OVERRUN × ~0 + SLACK 0.05 s), and the request stops
    at the next tick with a 422 naming the field, instead of computing the other three (~1.5 s)."""
    from dpledger.service.accounting import cost
    from dpledger.service.accounting.events import MechanismError
    from dpledger.service.ledger import charges
    from dpledger.wire.mechanisms import Composed, Gaussian, SampledWithoutReplacement

    monkeypatch.setitem(cost._LEAF_SECONDS, SampledWithoutReplacement, 0.0)
    monkeypatch.setitem(cost._INNER_SECONDS, SampledWithoutReplacement, 0.0)
    leaves = [SampledWithoutReplacement(source_size=10**9 + i, sample_size=10**6, event=Gaussian(noise_multiplier=1.0))
              for i in range(4)]
    started = time.thread_time()
    with pytest.raises(MechanismError) as stopped, cost.guard("mechanism", slack=0.05):
        charges.price(Composed(events=leaves), silo=None, charged=False)
    assert stopped.value.field == "mechanism" and "was stopped after" in stopped.value.message
    assert time.thread_time() - started < 1.0  # one leaf (~0.3–0.6 s), not four


def test_a_pld_report_that_outruns_its_price_is_skipped_and_the_quote_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    from dpledger.service.accounting import cost, reports
    from dpledger.wire.mechanisms import Composed, DpSgd

    monkeypatch.setitem(cost._POINT_SECONDS, "sampled", 0.0)  # priced as free: it is not (~0.3 s a leaf)
    monkeypatch.setattr(cost, "PLD_NODE_SECONDS", 0.0)
    monkeypatch.setattr(cost, "PART_SLACK", 0.01)
    mechanism = Composed(events=[DpSgd(sampling_rate=0.9 + i / 1000, noise_multiplier=0.5, steps=2) for i in range(4)])
    with cost.guard("mechanism"):
        report = reports.pld_epsilon(mechanism, delta=1e-5)
    assert report.epsilon is None and report.unsupported_reason is not None
    assert report.unsupported_reason.startswith("PLD report stopped after")
