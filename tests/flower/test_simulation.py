"""The same ClientApp (with its ledger mod) and ServerApp in Flower's simulation engine (Ray), against
a real `dpledger serve`: `flower-superlink --simulation`, `flwr run --federation-config
"num_supernodes=3 …"`. A virtual node's node config holds only its `partition-id`; each maps to a
silo's own settings through the file named by DPLEDGER_SIMULATION_NODES, never the run config.
"""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="flwr is not installed (the `flower` extra)")
pytest.importorskip("ray", reason="Ray is not installed (flwr's `simulation` extra)")

import json
import time
from collections.abc import Iterator
from typing import Any

from tests.flower.federation import Federation, budget_for_rounds, expected_epsilon, federation

TRAIN, TEST, SIGMA, STEPS, BATCH, ROUNDS = 120, 40, 1.0, 2, 16, 3


def epsilon_after(silo: Any, rounds: int) -> float:
    return expected_epsilon(silo, rounds=rounds, steps=STEPS, sampling_rate=BATCH / TRAIN, noise_multiplier=SIGMA)


# Silo 0 can afford exactly two rounds; the others every round.
BUDGETS = [budget_for_rounds(2, steps=STEPS, sampling_rate=BATCH / TRAIN, noise_multiplier=SIGMA, dataset_size=TRAIN),
           50.0, 50.0]


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    with federation(tmp_path_factory.mktemp("flower-sim"), budgets=BUDGETS, noise_multiplier=SIGMA, train=TRAIN,
                    test=TEST, simulation=True) as f:
        yield f


def test_fedavg_in_the_simulation_engine_charges_each_silo_its_rounds(fed: Federation) -> None:
    out = fed.folder / "fedavg.json"
    started = time.perf_counter()
    finished = fed.run(algorithm="fedavg", rounds=ROUNDS, **{
        "local-steps": STEPS, "batch-size": BATCH, "min-nodes": len(BUDGETS), "round-timeout": 120.0,
        "ledger-url": fed.ledger_url, "coordinator-key-file": str(fed.coordinator_key_file), "out": str(out)})
    seconds = time.perf_counter() - started
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    result = json.loads(out.read_text())
    print(f"simulation: {ROUNDS} rounds over {len(BUDGETS)} virtual nodes in {seconds:.1f} s (flwr run, wall); "
          f"round seconds {[round(r['seconds'], 2) for r in result['rounds']]}")
    ids = [s.silo_id for s in fed.silos]
    # The virtual nodes answered with the silo ids of their partitions' entries, one each.
    assert sorted(int(s) for s in result["silos"].values()) == ids
    assert [e["status"].get(str(ids[0])) for e in result["rounds"]] == ["trained", "trained", "declined"]
    for silo in ids[1:]:
        assert [e["status"][str(silo)] for e in result["rounds"]] == ["trained"] * ROUNDS
    with fed.ledger() as admin:
        for silo, rounds in zip(ids, (2, ROUNDS, ROUNDS), strict=True):
            detail = admin.silo(silo)
            assert detail.epsilon_spent == pytest.approx(epsilon_after(detail, rounds), rel=1e-9, abs=1e-9)
            assert detail.epsilon_committed == pytest.approx(detail.epsilon_spent, rel=1e-12)
