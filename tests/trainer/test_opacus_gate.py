"""An unmodified Opacus PrivacyEngine loop gated by the registered accountant, against the real app.

The ledger charges q = B/n with B the smallest batch size whose B/n covers Opacus' q = 1/len(loader);
Opacus' own RDP accountant uses q itself and its own order grid, and minimises over every order after
the fact, where the ledger reads ε through the silo's filter (orders and δ shares fixed at
registration, tests/gate_oracle.py). The test bounds their difference by what those three explain,
measured with dp-accounting."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from dp_accounting import dp_event as de
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from fastapi.testclient import TestClient
from opacus import PrivacyEngine
from torch.utils.data import DataLoader, TensorDataset

from dpledger.trainer.silo.gate import StepNotCovered
from dpledger.trainer.silo.opacus_gate import ACCOUNTANT, NotPoisson, OpacusGate
from dpledger.wire.client import LedgerClient
from tests.conftest import ADMIN_KEY
from tests.gate_oracle import ORDERS, dpsgd_epsilon, filter_pairs
from tests.trainer.test_gate import SmallCNN, digits

N, LOADER_BATCH, SIGMA, DELTA = 303, 32, 1.1, 1e-5  # len(loader) = 10, so Opacus' q = 0.1 and the ledger's 31/303


@pytest.fixture
def silo(client: TestClient) -> Iterator[tuple[LedgerClient, int]]:
    admin = LedgerClient("", ADMIN_KEY, http=client)
    created = admin.create_silo(name="opacus", epsilon=8.0, delta=DELTA, dataset_size=N)
    yield LedgerClient("", created.api_key, http=client), created.id


def private_loop(*, poisson_sampling: bool = True):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = SmallCNN()
    engine = PrivacyEngine(accountant=ACCOUNTANT)
    loader = DataLoader(TensorDataset(*digits(N)), batch_size=LOADER_BATCH)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.2), data_loader=loader,
        noise_multiplier=SIGMA, max_grad_norm=1.0, poisson_sampling=poisson_sampling,
    )
    return engine, model, optimizer, loader


def dp_accounting_epsilon(q: float, steps: int) -> tuple[float, float]:
    """dp-accounting's ε minimised over every order after the fact (no filter), and that order."""
    accountant = rdp_lib.RdpAccountant(ORDERS)
    accountant.compose(de.SelfComposedDpEvent(de.PoissonSampledDpEvent(q, de.GaussianDpEvent(SIGMA)), steps))
    epsilon, order = accountant.get_epsilon_and_optimal_order(DELTA)
    return float(epsilon), float(order)


def test_a_gated_opacus_loop_is_charged_what_opacus_counts_up_to_the_two_qs(silo) -> None:  # type: ignore[no-untyped-def]
    client, silo_id = silo
    engine, model, optimizer, loader = private_loop()
    gate = OpacusGate(client, silo_id=silo_id, privacy_engine=engine, module=model, optimizer=optimizer, data_loader=loader)
    assert gate.sampler.batch_size == 31  # ceil(0.1 · 303)
    rounds = 2
    for _ in range(rounds):
        with gate.round(steps=len(loader)):  # the loop below is Opacus' usual one, unchanged
            for x, y in loader:
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
    steps = rounds * len(loader)
    assert [(r.steps_taken, r.sampler) for r in gate.results] == [(len(loader), "poisson")] * rounds
    assert len(engine.accountant) == 1  # one (σ, q) entry in Opacus' own history, of 20 steps

    silo = client.silo(silo_id)
    ledger = silo.epsilon_spent
    opacus = engine.get_epsilon(DELTA)  # Opacus' own RDP accountant over the same steps, at its q = 0.1
    q_ledger, q_opacus = 31 / N, 1 / len(loader)
    assert ledger == pytest.approx(dpsgd_epsilon(silo, [(q_ledger, SIGMA, steps)], delta=DELTA), rel=1e-9)
    # What the q's explain, both read through the silo's filter.
    q_gap = ledger - dpsgd_epsilon(silo, [(q_opacus, SIGMA, steps)], delta=DELTA)
    # What the filter explains: orders and δ shares fixed before the first charge, against the best
    # order chosen after it. At that order α* the filter holds a share w of δ, so its ε is at most
    # ln(1/w)/(α* − 1) above (dp-accounting's conversion: ε(α, δ) = ρ + ln(1 − 1/α) − ln(δα)/(α − 1)).
    unconstrained, best = dp_accounting_epsilon(q_opacus, steps)
    filter_gap = dpsgd_epsilon(silo, [(q_opacus, SIGMA, steps)], delta=DELTA) - unconstrained
    share = dict(filter_pairs(silo))[best]
    grid_gap = abs(unconstrained - opacus)  # orders and ε conversion: dp-accounting's vs Opacus'
    assert 0 < q_gap < 0.05 * ledger  # q_ledger − q_opacus = 0.3/303 < 1/n
    assert 0 <= filter_gap <= math.log(1 / share) / (best - 1) + 1e-9
    assert grid_gap < 0.02 * opacus
    assert ledger >= opacus  # the ledger's q covers what the loader sampled
    assert abs(ledger - opacus) <= q_gap + filter_gap + grid_gap


def test_a_step_with_no_reservation_leaves_the_parameters_unchanged(silo) -> None:  # type: ignore[no-untyped-def]
    client, silo_id = silo
    engine, model, optimizer, loader = private_loop()
    gate = OpacusGate(client, silo_id=silo_id, privacy_engine=engine, module=model, optimizer=optimizer, data_loader=loader)
    batches = iter(loader)
    with gate.round(steps=1):
        x, y = next(batches)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        before = [p.detach().clone() for p in model.parameters()]
        x, y = next(batches)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(StepNotCovered, match="reserved 1 steps"):
            optimizer.step()  # one more than reserved
    x, y = next(batches)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(StepNotCovered, match="no round is open"):
        optimizer.step()  # outside any round
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert len(engine.accountant) == 1 and engine.accountant.history == [(SIGMA, 0.1, 1)]
    silo = client.silo(silo_id)
    assert silo.epsilon_spent == pytest.approx(dpsgd_epsilon(silo, [(31 / N, SIGMA, 1)], delta=DELTA), rel=1e-9)


def test_a_loader_that_is_not_poisson_is_refused_and_so_is_another_accountant(silo) -> None:  # type: ignore[no-untyped-def]
    client, silo_id = silo
    engine, model, optimizer, loader = private_loop(poisson_sampling=False)
    with pytest.raises(NotPoisson, match="poisson_sampling=True"):
        OpacusGate(client, silo_id=silo_id, privacy_engine=engine, module=model, optimizer=optimizer, data_loader=loader)
    plain = PrivacyEngine(accountant="rdp")
    with pytest.raises(ValueError, match=f"accountant={ACCOUNTANT!r}"):
        OpacusGate(client, silo_id=silo_id, privacy_engine=plain, module=model, optimizer=optimizer, data_loader=loader)
    assert math.isclose(client.silo(silo_id).epsilon_spent or 0.0, 0.0)
