"""Every algorithm of the registry, two rounds on Flower's simulation engine (Ray) against a real
`dpledger serve`: the ServerApp's strategy runs the algorithm's server half, each virtual node's
ClientApp its silo half behind the ledger gate. Each silo's ε is the oracle composition of what its
rounds should have cost (from each algorithm's documented cost, not from its code), and nothing the
server received or logged holds a budget.

One test per algorithm (`test_simulation_<name>`), made from the registry, so a new algorithm
without its run here fails `test_every_registered_algorithm_has_its_simulation_test`."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="flwr is not installed (the `flower` extra)")
pytest.importorskip("ray", reason="Ray is not installed (flwr's `simulation` extra)")

import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from dp_accounting import dp_event as de

from dpledger.trainer.federated import registry
from tests import gate_oracle
from tests.flower.federation import DELTA, Federation, assert_budget_blind, federation

TRAIN, TEST, SIGMA, STEPS, BATCH, ROUNDS, SILOS = 120, 30, 1.0, 2, 16, 2, 3
PERSONAL_STEPS, SELECTION_SIGMA, SERVER_NOISE = 1, 2.0, 4.0
Q = BATCH / TRAIN


def dpsgd(steps: int) -> np.ndarray:
    return gate_oracle.dpsgd_curve([(Q, SIGMA, steps)])


def selection(count: int) -> np.ndarray:
    """IFCA's private selection over every record (q_s = 1), σ_s = SELECTION_SIGMA, `count` times."""
    return gate_oracle.dpsgd_curve([(1.0, SELECTION_SIGMA, count)])


def server_gaussian(rounds: int) -> np.ndarray:
    return gate_oracle.event_curve(de.SelfComposedDpEvent(de.GaussianDpEvent(SERVER_NOISE / 2), rounds))


# Per algorithm: the options it runs with here, and the RDP curve its ROUNDS rounds cost one silo,
# from its documented cost (the registry's `cost` column).
CASES: dict[str, tuple[dict[str, Any], Callable[[], np.ndarray]]] = {
    "local": ({}, lambda: dpsgd(STEPS * ROUNDS)),
    "fedavg": ({}, lambda: dpsgd(STEPS * ROUNDS)),
    "mrmtl": ({"lam": 0.5}, lambda: dpsgd(STEPS * ROUNDS)),
    "ditto": ({"lam": 0.5, "personal-steps": PERSONAL_STEPS}, lambda: dpsgd((STEPS + PERSONAL_STEPS) * ROUNDS)),
    "finetune": ({"federated-rounds": 1}, lambda: dpsgd(STEPS * ROUNDS)),
    "ifca": ({"clusters": 2, "selection-noise-multiplier": SELECTION_SIGMA},
             lambda: dpsgd(STEPS * ROUNDS) + selection(ROUNDS)),
    "ifca_mrmtl": ({"clusters": 2, "lam": 0.5, "selection-rounds": 1, "selection-noise-multiplier": SELECTION_SIGMA},
                   lambda: dpsgd(STEPS * ROUNDS) + selection(1)),
    "pfa": ({}, lambda: dpsgd(STEPS * ROUNDS)),
    "fedhdp": ({"ratio": "budget_blind"}, lambda: dpsgd(STEPS * ROUNDS)),
    "ppsgd": ({"alpha": 0.5}, lambda: dpsgd(STEPS * ROUNDS)),
    "pmtl": ({"lam": 0.5, "server-noise": SERVER_NOISE, "update-clip": 1.0}, lambda: server_gaussian(ROUNDS)),
}


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    with federation(tmp_path_factory.mktemp("flower-family"), budgets=[200.0] * SILOS, noise_multiplier=SIGMA,
                    train=TRAIN, test=TEST, simulation=True) as f:
        yield f


@pytest.fixture(scope="module")
def charged() -> dict[int, list[np.ndarray]]:
    """Per silo id, the curve of every run this module made it pay for, in order (the ledger composes them all)."""
    return {}


def run_algorithm(fed: Federation, charged: dict[int, list[np.ndarray]], name: str) -> dict[str, Any]:
    """Runs `name` over the federation and checks each silo's ε and the server's blindness; returns the run's log."""
    options, cost = CASES[name]
    out = fed.folder / f"{name}.json"
    finished = fed.run(algorithm=name, rounds=ROUNDS, **{
        "local-steps": STEPS, "batch-size": BATCH, "min-nodes": SILOS, "round-timeout": 120.0,
        "ledger-url": fed.ledger_url, "coordinator-key-file": str(fed.coordinator_key_file), "out": str(out),
        **options})
    for silo in fed.silos:  # charged whether or not the run then went well: a round that ran is spent
        charged.setdefault(silo.silo_id, []).append(cost())
    assert finished.returncode == 0 and out.exists(), finished.stdout[-3000:] + finished.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["outcome"] == "complete", (result["rounds"], finished.stdout[-6000:])
    assert sorted(int(s) for s in result["accuracy"]) == sorted(s.silo_id for s in fed.silos)
    with fed.ledger() as admin:
        for silo in fed.silos:
            detail = admin.silo(silo.silo_id)
            expected = gate_oracle.proven_epsilon(gate_oracle.filter_pairs(detail), sum(charged[silo.silo_id]),
                                                  delta=DELTA)
            assert detail.epsilon_spent == pytest.approx(expected, rel=1e-9), (name, silo.silo_id)
            assert detail.epsilon_committed == pytest.approx(detail.epsilon_spent, rel=1e-12)
    assert_budget_blind(fed, finished.stdout + finished.stderr, result)
    return result


def _simulation_test(name: str) -> Callable[[Federation, dict[int, list[np.ndarray]]], None]:
    def test(fed: Federation, charged: dict[int, list[np.ndarray]]) -> None:
        result = run_algorithm(fed, charged, name)
        assert [sorted(entry["status"].values()) for entry in result["rounds"]] == [["trained"] * SILOS] * ROUNDS

    test.__name__ = f"test_simulation_{name}"
    test.__doc__ = f"{name}: {ROUNDS} rounds over {SILOS} virtual nodes, each silo charged its documented cost."
    return test


for _name in CASES:
    globals()[f"test_simulation_{_name}"] = _simulation_test(_name)


def test_every_registered_algorithm_has_its_simulation_test() -> None:
    assert set(CASES) == set(registry.algorithms())
