"""A real federation on 127.0.0.1: `dpledger serve`, `flower-superlink --insecure`, three
`flower-supernode`s (each its own data file and key file), and `flwr run` of FedAvg, MR-MTL, PMTL, IFCA.

Slow by nature (every round starts a ClientApp process per silo): one federation serves both runs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="flwr is not installed (the `flower` extra)")

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dp_accounting import dp_event as de

from tests import gate_oracle
from tests.faults.proxy import Proxy
from tests.flower.federation import (
    DELTA,
    Federation,
    assert_budget_blind,
    budget_for_rounds,
    expected_epsilon,
    federation,
    kill,
)

TRAIN, TEST, SIGMA, STEPS, BATCH, ROUNDS = 120, 40, 1.0, 2, 16, 4
ROUND_TIMEOUT = 100.0  # a killed SuperNode's round waits this long (Flower marks a node offline after ~60 s)
SERVER_NOISE = 4.0  # PMTL's z; each silo is charged the Gaussian at z/2 per round
# Silo 1 (the one killed mid-run) reaches the ledger through it (tests/faults/proxy.py).
PROXY = Proxy(0)


def epsilon_after(silo: Any, rounds: int, pmtl_rounds: int = 0) -> float:
    """The ε the silo's filter reads of `rounds` rounds, each STEPS Poisson-sampled Gaussian steps at
    q = B/n, then `pmtl_rounds` Gaussians at SERVER_NOISE / 2 (`expected_epsilon`, the one oracle)."""
    return expected_epsilon(silo, rounds=rounds, steps=STEPS, sampling_rate=BATCH / TRAIN, noise_multiplier=SIGMA,
                            pmtl_rounds=pmtl_rounds, server_noise=SERVER_NOISE)


# Silo 0 can afford exactly two rounds; the others all of them.
BUDGETS = [budget_for_rounds(2, steps=STEPS, sampling_rate=BATCH / TRAIN, noise_multiplier=SIGMA, dataset_size=TRAIN),
           50.0, 50.0]


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    with federation(tmp_path_factory.mktemp("flower"), budgets=BUDGETS, noise_multiplier=SIGMA, train=TRAIN, test=TEST,
                    proxy=PROXY, proxied=(1,)) as f:
        yield f


def run_config(fed: Federation, algorithm: str, out: Path, rounds: int = ROUNDS) -> dict[str, Any]:
    return {"algorithm": algorithm, "rounds": rounds, "local-steps": STEPS, "batch-size": BATCH, "lam": 0.5,
            "server-noise": SERVER_NOISE,
            "min-nodes": 3, "round-timeout": ROUND_TIMEOUT, "ledger-url": fed.ledger_url,
            "coordinator-key-file": str(fed.coordinator_key_file), "out": str(out)}


def trained_rounds(result: dict[str, Any]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for entry in result["rounds"]:
        for silo, status in entry["status"].items():
            counts[int(silo)] = counts.get(int(silo), 0) + (status == "trained")
    return counts


def test_fedavg_mrmtl_and_pmtl_over_flower(fed: Federation) -> None:
    # --- FedAvg: silo 0 trains two rounds, is declined in the third, and is asked no more.
    out = fed.folder / "fedavg.json"
    finished = fed.run(**run_config(fed, "fedavg", out))
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    fedavg = json.loads(out.read_text())
    ids = [s.silo_id for s in fed.silos]
    assert len(fedavg["rounds"]) == ROUNDS
    assert [e["status"].get(str(ids[0])) for e in fedavg["rounds"]] == ["trained", "trained", "declined", None]
    assert trained_rounds(fedavg) == {ids[0]: 2, ids[1]: ROUNDS, ids[2]: ROUNDS}
    with fed.ledger() as admin:
        for silo, rounds in zip(ids, (2, ROUNDS, ROUNDS), strict=True):
            detail = admin.silo(silo)
            assert detail.epsilon_spent == pytest.approx(epsilon_after(detail, rounds), rel=1e-9, abs=1e-9)
            assert detail.epsilon_committed == pytest.approx(detail.epsilon_spent, rel=1e-12)
    server_log = finished.stdout + finished.stderr + (fed.folder / "superlink.log").read_text()
    assert_budget_blind(fed, server_log, fedavg)
    # The silo's own log shows its ε as the ledger charges it (the gate's reading) after each round,
    # and in its refusal, each with dp-accounting's ε of the same charges beside it, labelled.
    with fed.ledger() as admin:
        commits = [e for e in admin.history(ids[0]) if e.event == "commit"]
    silo_log = "".join(path.read_text() for path in fed.folder.glob(f"*-{ids[0]}.log"))
    assert len(commits) == 2
    for number, entry in enumerate(commits, start=1):
        assert entry.epsilon_spent is not None and entry.epsilon_dp_accounting is not None
        assert entry.epsilon_dp_accounting <= entry.epsilon_spent
        assert (f"round {number} settled: ε spent {entry.epsilon_spent:.2f} of {fed.silos[0].epsilon:.2f} (the gate's "
                f"reading, what the ledger charges; dp-accounting's non-adaptive ε of the same charges, for reference: "
                f"{entry.epsilon_dp_accounting:.2f})") in silo_log
    assert "round 3 refused: it needs ε " in silo_log
    assert "in all (the gate's reading; dp-accounting's non-adaptive ε of the same charges, for reference: " in silo_log
    # Every silo evaluated the final model at home (accuracy after 8 noisy steps is not asserted:
    # the silos' noise comes from OS randomness, so it varies from run to run).
    assert set(fedavg["accuracy"]) == {str(s) for s in ids}

    # --- MR-MTL: silo 0 is declined at once; silo 1's SuperNode is killed while its round-1
    # reservation is open (at its commit, which never reaches the ledger); silo 2 finishes every round.
    out = fed.folder / "mrmtl.json"
    log_path = fed.folder / "flwr-run-mrmtl.log"
    victim = fed.silos[1]
    site = victim.process
    assert site is not None

    def round_1(body: bytes) -> bool:
        return bool(json.loads(body).get("round") == 1)

    # The victim reaches the ledger through the module's proxy: once the ledger has answered its
    # round-1 reservation, its site is killed before the answer reaches it (a poll for the open
    # reservation raced the commit once training got fast), so that reservation stays open, i.e. spent.
    reserve = rf"/v1/silos/{victim.silo_id}/charges"
    earlier = len(PROXY.seen(reserve))
    PROXY.add(reserve, body=round_1, after=lambda _request, _status: kill(site))
    runner = fed.start_run(log_path, **run_config(fed, "mrmtl", out))
    try:
        fed.wait_run(runner)
    finally:
        kill(runner)
        PROXY.clear()
    assert [e.status for e in PROXY.seen(reserve)[earlier:] if round_1(e.request.body)] == [201]  # reserved, then killed
    text = log_path.read_text()
    assert runner.returncode == 0, text[-3000:]
    mrmtl = json.loads(out.read_text())
    assert [e["status"].get(str(ids[0])) for e in mrmtl["rounds"]] == ["declined", None, None, None]
    # The killed silo is asked again every round (a silo that failed is not dropped); its node is gone.
    assert [e["status"].get(str(ids[1])) for e in mrmtl["rounds"]] == ["trained", "no reply", "no node", "no node"]
    assert [e["status"][str(ids[2])] for e in mrmtl["rounds"]] == ["trained"] * ROUNDS
    with fed.ledger() as admin:
        zero, one, two = (admin.silo(s) for s in ids)
        history = admin.history(ids[1])
    assert zero.epsilon_spent == pytest.approx(epsilon_after(zero, 2), rel=1e-9)
    # The killed round stays reserved, i.e. spent: ROUNDS + 1 committed, 1 reserved.
    assert one.epsilon_committed == pytest.approx(epsilon_after(one, ROUNDS + 1), rel=1e-9)
    assert one.epsilon_spent == pytest.approx(epsilon_after(one, ROUNDS + 2), rel=1e-9)
    assert [e.event for e in history].count("release") == 0
    assert two.epsilon_spent == pytest.approx(epsilon_after(two, 2 * ROUNDS), rel=1e-9)
    assert_budget_blind(fed, text + (fed.folder / "superlink.log").read_text(), mrmtl)

    # --- PMTL: the killed site comes back (a new SuperNode, the same key and data); the server
    # noises the aggregate and each silo that trains is charged the Gaussian at z/2 per round.
    fed.start_supernode(victim)
    out = fed.folder / "pmtl.json"
    finished = fed.run(**run_config(fed, "pmtl", out, rounds=2))
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    pmtl = json.loads(out.read_text())
    assert [e["status"] for e in pmtl["rounds"]] == [
        {str(ids[0]): "declined", str(ids[1]): "trained", str(ids[2]): "trained"},
        {str(ids[1]): "trained", str(ids[2]): "trained"},
    ]
    with fed.ledger() as admin:
        one, two = admin.silo(ids[1]), admin.silo(ids[2])
    assert one.epsilon_spent == pytest.approx(epsilon_after(one, ROUNDS + 2, pmtl_rounds=2), rel=1e-9)
    assert two.epsilon_spent == pytest.approx(epsilon_after(two, 2 * ROUNDS, pmtl_rounds=2), rel=1e-9)
    assert_budget_blind(fed, finished.stdout + finished.stderr, pmtl)


SELECTION_SIGMA = 2.0


def _curve(mechanism: dict[str, Any]) -> Any:
    """The RDP curve of a charged mechanism, as the oracle computes it (dp-accounting's events)."""
    if mechanism["type"] == "composed":
        return sum(_curve(event) for event in mechanism["events"])
    if mechanism["type"] == "dpsgd":
        return gate_oracle.dpsgd_curve([(mechanism["batch_size"] / TRAIN, mechanism["noise_multiplier"], mechanism["steps"])])
    assert mechanism["type"] == "gaussian", mechanism
    return gate_oracle.event_curve(de.GaussianDpEvent(mechanism["noise_multiplier"]))


def _declared(mechanism: dict[str, Any] | None) -> dict[str, Any] | None:
    """A charged mechanism as the silo declared it (the ledger adds the q it derived from the registered size)."""
    if mechanism is None or mechanism["type"] != "composed":
        return mechanism if mechanism is None else {k: v for k, v in mechanism.items() if k != "sampling_rate"}
    return {"type": "composed", "events": [_declared(event) for event in mechanism["events"]]}


def test_ifca_over_flower_charges_each_round_with_its_private_selection(fed: Federation) -> None:
    """IFCA over real SuperNodes: each silo's round is its DP-SGD steps composed with its private
    cluster selection (every record, σ_s), and its ε is the oracle composition of every charge it holds."""
    out = fed.folder / "ifca.json"
    finished = fed.run(**{**run_config(fed, "ifca", out, rounds=2), "clusters": 2,
                                               "selection-noise-multiplier": SELECTION_SIGMA})
    assert finished.returncode == 0 and out.exists(), finished.stdout[-3000:] + finished.stderr[-3000:]
    ifca = json.loads(out.read_text())
    job = f"flower-job-{ifca['job_id']}"
    expected = {"type": "composed", "events": [
        {"type": "dpsgd", "batch_size": BATCH, "noise_multiplier": SIGMA, "steps": STEPS},
        {"type": "dpsgd", "batch_size": TRAIN, "noise_multiplier": SELECTION_SIGMA, "steps": 1}]}
    with fed.ledger() as admin:
        for silo in fed.silos:
            history = admin.history(silo.silo_id)
            trained = sum(e["status"].get(str(silo.silo_id)) == "trained" for e in ifca["rounds"])
            charged = [_declared(e.mechanism) for e in history if e.event == "reserve" and e.job_id == job]
            assert len(charged) == trained and all(m == expected for m in charged), (silo.silo_id, charged)
            released = {e.charge_id for e in history if e.event == "release"}
            held = [e.mechanism for e in history
                    if e.event == "reserve" and e.mechanism is not None and e.charge_id not in released]
            detail = admin.silo(silo.silo_id)
            if not held:  # never charged (declined from its first round): it has spent nothing
                assert detail.epsilon_spent == 0.0
                continue
            curve = sum(_curve(m) for m in held)
            oracle = gate_oracle.proven_epsilon(gate_oracle.filter_pairs(detail), curve, delta=DELTA)
            assert detail.epsilon_spent == pytest.approx(oracle, rel=1e-9)
    assert sum(e["status"].get(str(fed.silos[2].silo_id)) == "trained" for e in ifca["rounds"]) == 2
    assert_budget_blind(fed, finished.stdout + finished.stderr, ifca)
