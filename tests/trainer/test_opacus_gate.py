"""An unmodified Opacus PrivacyEngine loop gated by the registered accountant, against the real app.

The ledger charges q = B/n with B the smallest batch size whose B/n covers Opacus' q = 1/len(loader);
Opacus' own RDP accountant uses q itself and its own order grid. The test bounds their difference by
what those two explain, measured with dp-accounting."""

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

from dpledger.trainer.client import LedgerClient
from dpledger.trainer.gate import StepNotCovered
from dpledger.trainer.opacus_gate import ACCOUNTANT, NotPoisson, OpacusGate
from tests.conftest import ADMIN_KEY
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


def dp_accounting_epsilon(q: float, steps: int) -> float:
    accountant = rdp_lib.RdpAccountant()
    accountant.compose(de.SelfComposedDpEvent(de.PoissonSampledDpEvent(q, de.GaussianDpEvent(SIGMA)), steps))
    return float(accountant.get_epsilon(DELTA))


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

    ledger = client.silo(silo_id).epsilon_spent
    opacus = engine.get_epsilon(DELTA)  # Opacus' own RDP accountant over the same steps, at its q = 0.1
    q_ledger, q_opacus = 31 / N, 1 / len(loader)
    assert ledger == pytest.approx(dp_accounting_epsilon(q_ledger, steps), rel=1e-9)
    q_gap = dp_accounting_epsilon(q_ledger, steps) - dp_accounting_epsilon(q_opacus, steps)  # what the q's explain
    grid_gap = abs(dp_accounting_epsilon(q_opacus, steps) - opacus)  # orders and ε conversion: dp-accounting's vs Opacus'
    assert 0 < q_gap < 0.05 * ledger  # q_ledger − q_opacus = 0.3/303 < 1/n
    assert grid_gap < 0.02 * opacus
    assert ledger >= opacus  # the ledger's q covers what the loader sampled
    assert abs(ledger - opacus) <= q_gap + grid_gap


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
    assert client.silo(silo_id).epsilon_spent == pytest.approx(dp_accounting_epsilon(31 / N, 1), rel=1e-9)


def test_a_loader_that_is_not_poisson_is_refused_and_so_is_another_accountant(silo) -> None:  # type: ignore[no-untyped-def]
    client, silo_id = silo
    engine, model, optimizer, loader = private_loop(poisson_sampling=False)
    with pytest.raises(NotPoisson, match="poisson_sampling=True"):
        OpacusGate(client, silo_id=silo_id, privacy_engine=engine, module=model, optimizer=optimizer, data_loader=loader)
    plain = PrivacyEngine(accountant="rdp")
    with pytest.raises(ValueError, match=f"accountant={ACCOUNTANT!r}"):
        OpacusGate(client, silo_id=silo_id, privacy_engine=plain, module=model, optimizer=optimizer, data_loader=loader)
    assert math.isclose(client.silo(silo_id).epsilon_spent or 0.0, 0.0)
