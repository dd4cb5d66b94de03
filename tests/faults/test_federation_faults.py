"""Faults of a real federation (tests/flower/federation.py: `dpledger serve`, a SuperLink, SuperNodes,
`flwr run`): a ClientApp process killed after its reservation, the ledger down for 20 s mid-round,
a SuperNode killed and restarted mid-run, the ServerApp stopped mid-run and resumed.

One federation serves the module: silo "steady" talks to the ledger directly; silo "victim" goes
through a proxy (tests/faults/proxy.py) whose hooks fire at exact points of its round protocol (its
reservation of round r, its commit), which is where the faults are injected. Every run is FedAvg of
the same DP-SGD round, so a silo's ε is the oracle of the number of charges it holds (committed or
reserved) over all the module's runs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="flwr is not installed (the `flower` extra)")

import json
import os
import signal
import subprocess
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from dpledger.wire.enums import Role
from tests.faults.conftest import command_line, listed_charges, named, sender_of, signal_all, stop_tree, wait_for
from tests.faults.proxy import Exchange, Proxy, Request
from tests.flower.federation import (
    BIN,
    DELTA,
    RUN_LIMIT_SECONDS,
    Federation,
    Silo,
    descendants,
    expected_epsilon,
    federation,
    write_silo_files,
)

TRAIN, TEST, SIGMA, STEPS, BATCH, BUDGET = 120, 40, 1.0, 2, 16, 50.0
# A round that never gets an answer (a killed ClientApp or SuperNode) lasts this long; a healthy round
# of two silos takes 5–15 s on two idle cores, 40–75 s on two cores shared with a load average of 20.
ROUND_TIMEOUT = 90.0
COMMIT = r"/v1/charges/\d+/commit"
OUTAGE = 20.0  # seconds the ledger is down in the restart test


@dataclass
class Faulty:
    fed: Federation
    proxy: Proxy
    steady: Silo
    victim: Silo

    @property
    def reserve_path(self) -> str:
        return rf"/v1/silos/{self.victim.silo_id}/charges"

    def run_config(self, out: Path, *, rounds: int, round_timeout: float) -> dict[str, Any]:
        return {"algorithm": "fedavg", "rounds": rounds, "local-steps": STEPS, "batch-size": BATCH, "min-nodes": 2,
                "round-timeout": round_timeout, "ledger-url": self.fed.ledger_url,
                "coordinator-key-file": str(self.fed.coordinator_key_file), "out": str(out)}

    def run(self, name: str, *, rounds: int, round_timeout: float) -> dict[str, Any]:
        """One `flwr run` to its end; its out JSON."""
        out = self.fed.folder / f"{name}.json"
        log = self.fed.folder / f"flwr-run-{name}.log"
        runner = self.fed.start_run(log, **self.run_config(out, rounds=rounds, round_timeout=round_timeout))
        try:
            self.fed.wait_run(runner)
        finally:
            stop_tree(runner)
        text = log.read_text()
        assert runner.returncode == 0, text[-4000:]
        assert out.exists(), text[-4000:]
        result: dict[str, Any] = json.loads(out.read_text())
        return result

    def start_victim(self) -> None:
        """The victim's SuperNode, its ledger URL the proxy's."""
        direct = self.fed.ledger_url
        self.fed.ledger_url = self.proxy.url
        try:
            self.fed.start_supernode(self.victim)
        finally:
            self.fed.ledger_url = direct


CLIENTAPPS_QUIET = 10.0
# A ClientApp of a stopped run that lives longer than a round may take is stopped as an operator would
# (SIGTERM: a permit it holds is settled first). Flower 1.41 gives a claimed task 30 s to send its first
# heartbeat, then hands it to a new ClientApp: a starved machine can relaunch a stopped run's task for
# as long as start-ups stay that slow, so after STOPPED_RUN_LIMIT s the SuperNodes are restarted (a
# site restarted by its operator: the stopped run's tasks go with them).
STOPPED_RUN_LIMIT = 3 * ROUND_TIMEOUT


def clientapps_of(faulty: Faulty) -> list[int]:
    return [pid for silo in (faulty.steady, faulty.victim) if silo.process is not None
            for pid in descendants(silo.process.pid) if named(pid, "flwr-clientapp")]


def wait_clientapps_quiet(faulty: Faulty) -> None:
    """Until no `flwr-clientapp` has run under either site's SuperNode for CLIENTAPPS_QUIET s (the
    SuperNodes poll every 3 s). A ClientApp older than ROUND_TIMEOUT gets SIGTERM; past
    STOPPED_RUN_LIMIT the SuperNodes are restarted, once (either is a warning naming what was seen);
    ClientApps still running STOPPED_RUN_LIMIT s after that fail the test."""
    started = quiet_since = time.monotonic()
    seen: dict[int, float] = {}
    restarted = False
    while time.monotonic() - quiet_since < CLIENTAPPS_QUIET:
        now = time.monotonic()
        live = clientapps_of(faulty)
        if live:
            quiet_since = now
        for pid in live:
            if now - seen.setdefault(pid, now) > ROUND_TIMEOUT:
                warnings.warn(f"a ClientApp of the stopped run ran {now - seen[pid]:.0f} s: SIGTERM to "
                              f"{' '.join(command_line(pid))[:300]}", stacklevel=1)
                signal_all([pid], signal.SIGTERM)
                seen[pid] = float("inf")  # stopped once; quiet still waits for it to end
        if now - started > STOPPED_RUN_LIMIT:
            tails = {silo.silo_id: silo.log.read_text(errors="replace")[-800:] for silo in (faulty.steady, faulty.victim)
                     if silo.log is not None}
            said = (f"ClientApps kept running {STOPPED_RUN_LIMIT:.0f} s after the run stopped ({len(seen)} seen, "
                    f"{len(live)} live); the SuperNodes' logs ended {tails}")
            if restarted:
                pytest.fail(f"{said}, after their restart")
            warnings.warn(f"{said}: the SuperNodes are restarted", stacklevel=1)
            restarted = True
            for silo in (faulty.steady, faulty.victim):
                assert silo.process is not None
                stop_tree(silo.process, signal.SIGTERM)
            faulty.fed.start_supernode(faulty.steady)
            faulty.start_victim()
            started = quiet_since = time.monotonic()
        time.sleep(0.5)


def round_of(round_index: int) -> Any:
    """A proxy body predicate: a reservation of round `round_index`."""
    def matches(body: bytes) -> bool:
        try:
            return bool(json.loads(body).get("round") == round_index)
        except ValueError:
            return False

    return matches


def ledger_port(fed: Federation) -> int:
    port = urlsplit(fed.ledger_url).port
    assert port is not None
    return port


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faulty]:
    folder = tmp_path_factory.mktemp("faults")
    with federation(folder, budgets=[BUDGET], noise_multiplier=SIGMA, train=TRAIN, test=TEST) as fed, \
            Proxy(ledger_port(fed)) as proxy:
        # The victim's data: the second of two disjoint slices (the steady silo holds the first).
        (folder / "victim").mkdir()
        data = write_silo_files(folder / "victim", silos=2, train=TRAIN, test=TEST)[1]
        with fed.ledger() as admin:
            created = admin.create_silo(name="site-victim", epsilon=BUDGET, delta=DELTA, dataset_size=TRAIN)
        key_file = folder / f"silo-{created.id}.key"
        key_file.write_text(created.api_key)
        key_file.chmod(0o600)
        victim = Silo(created.id, BUDGET, key_file, data, SIGMA)
        fed.silos.append(victim)
        faults = Faulty(fed=fed, proxy=proxy, steady=fed.silos[0], victim=victim)
        faults.start_victim()
        yield faults


def charges_of(faults: Faulty, silo: Silo, **query: str) -> list[dict[str, Any]]:
    return listed_charges(faults.fed.ledger_url, faults.fed.admin_key, silo.silo_id, **query)


def expected_epsilon_of(detail: Any, charges: int) -> float:
    """The oracle's ε of `charges` rounds of the module's DP-SGD on the silo `detail` describes."""
    return expected_epsilon(detail, rounds=charges, steps=STEPS, sampling_rate=BATCH / TRAIN, noise_multiplier=SIGMA)


def assert_ledger_matches(faults: Faulty, silo: Silo) -> dict[str, Any]:
    """The silo's ε on the ledger is the oracle of the charges it holds (every charge one round of
    the same DP-SGD), committed and spent alike; no charge was ever released. Returns the charges by status."""
    # One moment's charges and detail: a ClientApp of a stopped run may still reserve or commit (on a busy
    # machine, after the run ended), so the list is read between two equal readings of the silo.
    for _ in range(60):
        with faults.fed.ledger() as admin:
            before = admin.silo(silo.silo_id)
            charges = charges_of(faults, silo)
            detail = admin.silo(silo.silo_id)
        if (before.epsilon_spent, before.epsilon_committed) == (detail.epsilon_spent, detail.epsilon_committed):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"silo {silo.silo_id}'s ledger kept changing for 30 s")
    with faults.fed.ledger() as admin:
        history = admin.history(silo.silo_id)
    statuses = Counter(c["status"] for c in charges)
    assert statuses["released"] == 0, charges
    assert [e.event for e in history].count("release") == 0
    held = statuses["committed"] + statuses["reserved"]
    assert detail.epsilon_spent == pytest.approx(expected_epsilon_of(detail, held), rel=1e-9)
    if statuses["committed"]:
        assert detail.epsilon_committed == pytest.approx(expected_epsilon_of(detail, statuses["committed"]), rel=1e-9)
    return {"charges": charges, "statuses": statuses}


def statuses_of(result: dict[str, Any], silo: Silo) -> list[str | None]:
    return [entry["status"].get(str(silo.silo_id)) for entry in result["rounds"]]


def job_name(faults: Faulty, silo: Silo, result: dict[str, Any]) -> str:
    """The job name the run's charges carry, as the ledger lists them (whatever prefix the mod uses)."""
    names = {c["job_id"] for c in charges_of(faults, silo) if c["job_id"].endswith(f"-{result['job_id']}")
             or c["job_id"] == str(result["job_id"])}
    assert len(names) <= 1, names
    return names.pop() if names else str(result["job_id"])


def owned_answers(exchanges: list[Exchange]) -> Counter[int]:
    """Round → how many reservations the victim was answered as its own open charge (a permit to train)."""
    owned: Counter[int] = Counter()
    for exchange in exchanges:
        request, answer = exchange.request_json(), exchange.json()
        if (exchange.answered and isinstance(request, dict) and isinstance(answer, dict)
                and answer.get("status") == "reserved" and answer.get("attempt_id") is not None
                and answer.get("attempt_id") == request.get("attempt_id")):
            owned[int(request["round"])] += 1
    return owned


# --- 2. a ClientApp process killed after its reservation, before its commit ----------------------------
def test_a_clientapp_killed_after_its_reservation_never_trains_twice(faulty: Faulty) -> None:
    victim = faulty.victim
    assert victim.process is not None
    killed: list[list[str]] = []
    charge_ids: list[int] = []

    def kill_clientapp(request: Request) -> None:
        """The process that sent the commit (the ClientApp that ran the round) dies before it lands."""
        charge_ids.append(int(request.path.split("/")[3]))
        pid = sender_of(request.peer_port)
        if pid is not None:
            killed.append(command_line(pid))
            signal_all([pid], signal.SIGKILL)

    start = len(faulty.proxy.exchanges)
    # Round 0's commit never reaches the ledger: its ClientApp dies once it trained, before the commit.
    faulty.proxy.add(COMMIT, action="drop_request", before=kill_clientapp)
    try:
        result = faulty.run("killed-clientapp", rounds=2, round_timeout=ROUND_TIMEOUT)
    finally:
        faulty.proxy.clear()
    assert killed, "the process that sent the victim's commit was not found"
    assert "flwr-clientapp" in " ".join(killed[0]), killed  # the site's ClientApp, nothing else
    victim_rounds = statuses_of(result, victim)
    assert victim_rounds[0] != "trained", victim_rounds
    # The site itself is alive: it is asked again next round, and trains under a new key.
    assert victim_rounds[1] == "trained", victim_rounds
    assert statuses_of(result, faulty.steady) == ["trained"] * 2

    # At most one training per (job, round, silo): the permits the victim was given, the trained replies.
    exchanges = [e for e in faulty.proxy.exchanges[start:] if e.request.method == "POST"]
    reserves = [e for e in exchanges if e.request.path == f"/v1/silos/{victim.silo_id}/charges"]
    owned = owned_answers(reserves)
    assert all(n <= 1 for n in owned.values()), owned
    assert owned[0] == 1  # round 0 was approved once (and trained, then killed)
    for index, status in enumerate(victim_rounds):
        assert status != "trained" or owned[index] == 1, (index, victim_rounds, owned)

    # The killed round's charge stays spent (reserved: nobody committed it), never released.
    job = job_name(faulty, victim, result)
    charges = charges_of(faulty, victim, job_id=job)
    by_round = Counter(c["round"] for c in charges)
    assert all(n == 1 for n in by_round.values()), charges
    killed_charge = next(c for c in charges if c["charge_id"] == charge_ids[0])
    assert (killed_charge["round"], killed_charge["status"]) == (0, "reserved")
    assert {c["round"] for c in charges if c["status"] == "committed"} == {
        i for i, s in enumerate(victim_rounds) if s == "trained"}
    assert_ledger_matches(faulty, victim)
    assert_ledger_matches(faulty, faulty.steady)


# --- 3. the ledger down for 20 s mid-round, then started again on its port and database ----------------
def test_a_ledger_down_for_20_s_mid_round_loses_no_silo(faulty: Faulty) -> None:
    fed = faulty.fed
    serve = next(p for p in fed.processes if "serve" in map(str, p.args) and p.poll() is None)  # type: ignore[arg-type]
    command = [str(a) for a in serve.args]  # type: ignore[union-attr]
    before = {s.silo_id: len(charges_of(faulty, s, status="committed")) for s in (faulty.steady, faulty.victim)}
    times: dict[str, float] = {}
    restarted = threading.Event()

    def restart() -> None:
        time.sleep(OUTAGE)
        times["restarted"] = time.monotonic()
        fed.start(command, fed.folder / "ledger-restarted.log")
        restarted.set()

    def stop_ledger(request: Request) -> None:
        times["stopped"] = time.monotonic()
        stop_tree(serve, signal.SIGKILL)
        threading.Thread(target=restart, daemon=True).start()

    # The victim's round-1 reservation finds the ledger gone; so does whatever the steady silo sends next.
    faulty.proxy.add(faulty.reserve_path, body=round_of(1), before=stop_ledger)
    start = len(faulty.proxy.exchanges)
    try:
        result = faulty.run("ledger-restart", rounds=2, round_timeout=ROUND_TIMEOUT + OUTAGE)
    finally:
        faulty.proxy.clear()
        restarted.wait(timeout=OUTAGE + 30)
    assert "stopped" in times and restarted.is_set()
    # The victim met the outage: requests that found no ledger, then answers from the new one.
    unanswered = [e for e in faulty.proxy.exchanges[start:] if e.status is None]
    assert unanswered, "no request of the victim found the ledger down"
    assert statuses_of(result, faulty.steady) == ["trained"] * 2
    assert statuses_of(result, faulty.victim) == ["trained"] * 2
    for silo in (faulty.steady, faulty.victim):
        assert len(charges_of(faulty, silo, status="committed")) == before[silo.silo_id] + 2
        assert_ledger_matches(faulty, silo)
    assert times["restarted"] - times["stopped"] >= OUTAGE


# --- 4. a SuperNode killed mid-run and started again: the silo is asked again ------------------------
def test_a_supernode_killed_and_restarted_is_asked_again(faulty: Faulty) -> None:
    victim = faulty.victim
    before = len(charges_of(faulty, victim, status="committed"))
    old = victim.process
    assert old is not None

    def kill_supernode(request: Request) -> None:
        stop_tree(old, signal.SIGKILL)  # before its round-0 reservation: round 0 charges nothing
        faulty.start_victim()

    faulty.proxy.add(faulty.reserve_path, body=round_of(0), action="drop_request", before=kill_supernode)
    try:
        result = faulty.run("supernode-restart", rounds=2, round_timeout=ROUND_TIMEOUT)
    finally:
        faulty.proxy.clear()
    wait_for(lambda: victim.process is not old, timeout=10, what="the victim's SuperNode restart")
    rounds = statuses_of(result, victim)
    assert rounds[0] not in ("trained", "declined"), rounds
    assert rounds[1] == "trained", f"the victim was not asked again after its SuperNode came back: {rounds}"
    assert statuses_of(result, faulty.steady) == ["trained"] * 2
    # Its ε is the oracle of the rounds it trained (round 0 reserved nothing).
    assert len(charges_of(faulty, victim, job_id=job_name(faulty, victim, result))) == 1
    assert len(charges_of(faulty, victim, status="committed")) == before + 1
    assert_ledger_matches(faulty, victim)
    assert_ledger_matches(faulty, faulty.steady)


# --- 5. the ServerApp stopped mid-run: the rounds it aggregated written, and one line -----------------
def test_a_serverapp_stopped_mid_run_writes_the_rounds_it_aggregated_and_says_so_in_one_line(faulty: Faulty) -> None:
    fed, rounds = faulty.fed, 30
    out, log = fed.folder / "stopped.json", fed.folder / "flwr-run-stopped.log"
    runner = fed.start_run(log, **faulty.run_config(out, rounds=rounds, round_timeout=ROUND_TIMEOUT))
    try:
        wait_for(lambda: "round 2:" in log.read_text(errors="replace"), timeout=RUN_LIMIT_SECONDS, what="round 2 aggregated")
        serverapp = wait_for(lambda: next((pid for process in fed.processes for pid in descendants(process.pid)
                                           if named(pid, "flwr-serverapp")), None), timeout=30, what="the ServerApp")
        os.kill(serverapp, signal.SIGTERM)
        fed.wait_run(runner)
    finally:
        stop_tree(runner)
    # `dpledger flwr-run` (federation.py's runner) exits with the run's outcome, not flwr run's 0.
    assert runner.returncode == 1, log.read_text(errors="replace")[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    aggregated = len(result["rounds"])
    assert result["outcome"] == "interrupted" and 2 <= aggregated < rounds, (result["outcome"], aggregated)
    line = (f"job {result['job_id']} interrupted after {aggregated} of {rounds} rounds (the ServerApp was stopped): "
            "the out JSON holds those rounds; each silo's ledger holds what its rounds spent; "
            "continue it with the same run config and resume=true")
    assert result["reason"] == line
    said = log.read_text(errors="replace") + (fed.folder / "superlink.log").read_text(errors="replace")
    assert line in said and "Traceback" not in said[said.index(line):], said[-3000:]
    # A ClientApp of the stopped run may still be starting on a busy machine (its message was delivered
    # before the ServerApp stopped), and reserve after the charges below are read: they are read once
    # no ClientApp has run at either site for CLIENTAPPS_QUIET seconds.
    wait_clientapps_quiet(faulty)
    # Each silo settled the round it was in by itself: the ServerApp's end leaves no charge of the job open.
    for silo in (faulty.steady, faulty.victim):
        name = job_name(faulty, silo, result)
        wait_for(lambda s=silo, n=name: all(c["status"] == "committed" for c in charges_of(faulty, s, job_id=n)),
                 timeout=ROUND_TIMEOUT, what=f"silo {silo.silo_id}'s charges of the job settled")
        assert len(charges_of(faulty, silo, job_id=name)) >= aggregated
        assert_ledger_matches(faulty, silo)
    # A resume without the stopped run's checkpoint fails in one line, and flwr-run says so with exit 1.
    elsewhere = fed.folder / "elsewhere.json"
    refused = fed.run(**faulty.run_config(elsewhere, rounds=rounds, round_timeout=ROUND_TIMEOUT),
                      resume=True)
    said = refused.stdout + refused.stderr + (fed.folder / "superlink.log").read_text(errors="replace")
    assert refused.returncode == 1, said[-3000:]
    assert (f"resume: no checkpoint at {fed.folder / 'elsewhere.checkpoint'} (a run writes it beside its out JSON "
            "after each round; give the stopped run's out)") in said
    assert "finished:failed" in refused.stderr and not elsewhere.exists()
    in_flight = {silo.silo_id: Counter(c["round"] for c in charges_of(faulty, silo, job_id=job_name(faulty, silo, result)))
                 for silo in (faulty.steady, faulty.victim)}

    # Started again with resume=true (and one round more than it aggregated, to end soon): the same job, from the first
    # round not aggregated; the round a silo was training when the ServerApp stopped stays spent and
    # is trained again under a charge of its own; no other round is charged twice.
    total = aggregated + 1
    config = faulty.run_config(out, rounds=total, round_timeout=ROUND_TIMEOUT) | {"resume": True}
    log = fed.folder / "flwr-run-resumed.log"
    runner = fed.start_run(log, **config)
    try:
        fed.wait_run(runner)
    finally:
        stop_tree(runner)
    assert runner.returncode == 0, log.read_text(errors="replace")[-3000:]
    resumed: dict[str, Any] = json.loads(out.read_text())
    said = log.read_text(errors="replace") + (fed.folder / "superlink.log").read_text(errors="replace")
    assert resumed["outcome"] == "complete" and resumed["job_id"] == result["job_id"], said[-3000:]
    assert [entry["round"] for entry in resumed["rounds"]] == list(range(total))
    assert f"job {result['job_id']} resumed at round {aggregated + 1} of {total}" in said
    for silo in (faulty.steady, faulty.victim):
        charges = charges_of(faulty, silo, job_id=job_name(faulty, silo, result))
        per_round = Counter(c["round"] for c in charges)
        stopped_round = in_flight[silo.silo_id].get(aggregated, 0)
        assert per_round == Counter({r: 1 for r in range(total)}) + Counter({aggregated: stopped_round}), per_round
        assert {c["status"] for c in charges} == {"committed"}
        assert_ledger_matches(faulty, silo)
    # An auditor finds nothing: the log, every leaf against its record, every silo's ε recomposed.
    with fed.ledger() as admin:
        auditor = admin.create_key(role=Role.auditor).api_key
    audit = subprocess.run([str(BIN / "dpledger"), "audit", "--since", str(fed.folder / "head.json")], check=False,
                           env={**fed.env(), "DPLEDGER_URL": fed.ledger_url, "DPLEDGER_KEY": auditor},
                           capture_output=True, text=True, timeout=300)
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-3000:]
