"""The round gate around the DP-SGD engine, against the real app over a migrated database: a user's
own CNN trains for several rounds and the ledger charges exactly the steps that ran (dp-accounting's
curves read through the silo's published filter as the oracle, tests/gate_oracle.py); denials,
replays and steps beyond a reservation run nothing; an exception after a step leaves the charge
committed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient
from sklearn.datasets import load_digits
from torch import Tensor, nn

from dpledger.trainer.silo.dpsgd.engine import DPSGDEngine
from dpledger.trainer.silo.gate import RoundGate, StepNotCovered
from dpledger.trainer.silo.registered import SizeMismatch
from dpledger.wire.client import LedgerClient
from dpledger.wire.enums import ChargeStatus
from dpledger.wire.errors import Denied, NotOwned
from tests.conftest import ADMIN_KEY
from tests.gate_oracle import dpsgd_epsilon

N, BATCH, DELTA = 300, 30, 1e-5


class SmallCNN(nn.Module):
    """A user's own model: conv + GroupNorm + linear (no BatchNorm: it would mix examples)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, kernel_size=3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.head = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = F.max_pool2d(F.relu(self.norm(self.conv(x))), 2)
        return self.head(h.flatten(1))


def per_example_loss(output: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(output, y, reduction="none")


def digits(n: int = N) -> tuple[Tensor, Tensor]:
    data = load_digits()
    x = torch.tensor(data.images[:n] / 16.0, dtype=torch.float32).unsqueeze(1)
    return x, torch.tensor(data.target[:n], dtype=torch.int64)


def make_engine(seed: int = 0, *, model: nn.Module | None = None) -> DPSGDEngine:
    torch.manual_seed(seed)
    model = model or SmallCNN()
    return DPSGDEngine(
        model, torch.optim.SGD(model.parameters(), lr=0.5), loss_fn=per_example_loss, data=digits(),
        batch_size=BATCH, max_grad_norm=1.0, generator=torch.Generator().manual_seed(seed),
    )


@pytest.fixture
def silo(client: TestClient) -> Iterator[tuple[LedgerClient, int]]:
    def make(epsilon: float) -> tuple[LedgerClient, int]:
        admin = LedgerClient("", ADMIN_KEY, http=client)
        created = admin.create_silo(name=f"cnn-{epsilon}", epsilon=epsilon, delta=DELTA, dataset_size=N)
        return LedgerClient("", created.api_key, http=client), created.id

    yield make  # type: ignore[misc]


def gate_epsilon(client: LedgerClient, silo_id: int, blocks: list[tuple[float, int]], *, q: float = BATCH / N) -> float:
    """The proven ε of (σ, steps) blocks of DP-SGD on this silo: dp-accounting's curves, composed and
    converted through the filter the silo publishes."""
    return dpsgd_epsilon(client.silo(silo_id), [(q, sigma, steps) for sigma, steps in blocks], delta=DELTA)


def parameters(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a: list[Tensor], b: list[Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_user_cnn_trains_through_the_gate_and_the_ledger_charges_exactly_the_steps_that_ran(silo) -> None:  # type: ignore[no-untyped-def]
    client, silo_id = silo(4.0)
    engine = make_engine()
    gate = RoundGate(client, silo_id=silo_id, sampler=engine.sampler)
    rounds, steps = 3, 4
    plan = gate.calibrate(rounds=rounds, steps_per_round=steps)
    x, y = digits()
    before = per_example_loss(engine.model(x), y).mean().item()
    start = parameters(engine.model)
    for _ in range(rounds):
        with gate.round(steps=steps, noise_multiplier=plan.noise_multiplier) as permit:
            for _ in range(permit.steps):
                engine.step(permit)
    assert not same(start, parameters(engine.model))
    expected = [(i, steps, ChargeStatus.committed, "poisson") for i in range(rounds)]
    assert [(r.round, r.steps_taken, r.status, r.sampler) for r in gate.results] == expected
    ran = [(r.noise_multiplier, r.steps_taken) for r in gate.results]
    spent = client.silo(silo_id).epsilon_spent
    assert spent == pytest.approx(gate_epsilon(client, silo_id, ran), rel=1e-9)
    assert spent <= 4.0  # the calibration planned exactly these rounds into what was left
    assert spent == pytest.approx(4.0, rel=1e-4)
    assert per_example_loss(engine.model(x), y).mean().item() < before  # it learns something


def clipped_mean_one_at_a_time(model: nn.Module, x: Tensor, y: Tensor, *, max_grad_norm: float, batch: float) -> list[Tensor]:
    """The definition (Abadi et al. 2016, Alg. 1), one example at a time: Σ_i g_i·min(1, C/‖g_i‖) / B."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(per_example_loss(model(x[i : i + 1]), y[i : i + 1]).sum(), params)
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        factor = min(1.0, max_grad_norm / float(norm))
        total = [t + factor * g for t, g in zip(total, grads, strict=True)]
    return [t / batch for t in total]


def test_the_engine_gradient_equals_one_example_at_a_time_and_opacus_with_noise_zero() -> None:
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    engine = make_engine(seed=3)
    x, y = digits(24)
    engine.max_grad_norm = 0.3  # small enough that most examples are clipped
    private = engine.private_gradient(x, y, noise_multiplier=0.0)
    assert (private.norms > 0.3).float().mean() > 0.5
    reference = clipped_mean_one_at_a_time(engine.model, x, y, max_grad_norm=0.3, batch=BATCH)
    for mine, theirs in zip(private.grads, reference, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)

    twin = SmallCNN()
    twin.load_state_dict(engine.model.state_dict())
    wrapped = GradSampleModule(twin, loss_reduction="mean")  # Opacus' usual setup: a mean loss, divided by B
    optimizer = DPOptimizer(torch.optim.SGD(wrapped.parameters(), lr=0.1), noise_multiplier=0.0, max_grad_norm=0.3,
                            expected_batch_size=BATCH, loss_reduction="mean")
    x.requires_grad_(True)  # so the first layer's full backward hook sees an input gradient
    F.cross_entropy(wrapped(x), y).backward()
    optimizer.pre_step()
    # Opacus clips by C/(‖g‖ + 1e-6): equal to ours within that 1e-6 relative.
    for mine, p in zip(private.grads, twin.parameters(), strict=True):
        torch.testing.assert_close(mine, p.grad, rtol=1e-4, atol=1e-6)


def test_a_denial_runs_no_step_and_is_final(silo) -> None:  # type: ignore[no-untyped-def]
    client, silo_id = silo(0.5)
    engine = make_engine()
    gate = RoundGate(client, silo_id=silo_id, sampler=engine.sampler)
    start, sampler_state = parameters(engine.model), engine.generator.get_state()
    entered = []
    with pytest.raises(Denied) as denied:
        with gate.round(steps=500, noise_multiplier=0.8):
            entered.append(True)
    assert denied.value.epsilon == 0.5 and denied.value.epsilon_if_approved > 0.5
    assert not entered and same(start, parameters(engine.model)) and torch.equal(sampler_state, engine.generator.get_state())
    with pytest.raises(Denied):  # final: a smaller round is not even asked for
        with gate.round(steps=1, noise_multiplier=50.0):
            entered.append(True)
    assert not entered and client.silo(silo_id).epsilon_spent == 0.0


def test_a_replayed_settled_charge_runs_no_step(silo) -> None:  # type: ignore[no-untyped-def]
    client, silo_id = silo(5.0)
    engine = make_engine()
    first = RoundGate(client, silo_id=silo_id, sampler=engine.sampler, job_id="nightly")
    with first.round(steps=2, noise_multiplier=1.5) as permit:
        engine.step(permit)
        engine.step(permit)
    spent = client.silo(silo_id).epsilon_spent
    again = RoundGate(client, silo_id=silo_id, sampler=engine.sampler, job_id="nightly")  # the same script, re-run
    start, entered = parameters(engine.model), []
    with pytest.raises(NotOwned, match=f"charge {first.results[0].charge_id}"):
        with again.round(steps=2, noise_multiplier=1.5, round=0):
            entered.append(True)
    assert not entered and same(start, parameters(engine.model))
    assert client.silo(silo_id).epsilon_spent == spent and again.results == []


def test_an_exception_mid_round_leaves_the_charge_committed(silo) -> None:  # type: ignore[no-untyped-def]
    client, silo_id = silo(5.0)
    engine = make_engine()
    gate = RoundGate(client, silo_id=silo_id, sampler=engine.sampler)
    with pytest.raises(RuntimeError, match="disk full"):
        with gate.round(steps=3, noise_multiplier=1.5) as permit:
            engine.step(permit)
            raise RuntimeError("disk full")
    result = gate.results[0]
    assert result.status is ChargeStatus.committed and result.steps_taken == 1 and "disk full" in (result.error or "")
    events = [e.event for e in client.history(silo_id) if e.charge_id == result.charge_id]
    assert events == ["reserve", "commit"]
    # The whole reserved round stays spent (one step ran, three were reserved): the safe side.
    assert client.silo(silo_id).epsilon_spent == pytest.approx(gate_epsilon(client, silo_id, [(1.5, 3)]), rel=1e-9)

    with pytest.raises(KeyError):  # raised before any step: nothing was touched, the charge is returned
        with gate.round(steps=3, noise_multiplier=1.5):
            raise KeyError("config")
    assert gate.results[1].status is ChargeStatus.released and gate.results[1].steps_taken == 0
    assert client.silo(silo_id).epsilon_spent == pytest.approx(gate_epsilon(client, silo_id, [(1.5, 3)]), rel=1e-9)


def test_a_step_the_reservation_does_not_cover_reads_nothing_and_moves_nothing(silo) -> None:  # type: ignore[no-untyped-def]
    client, silo_id = silo(5.0)
    engine = make_engine()
    gate = RoundGate(client, silo_id=silo_id, sampler=engine.sampler)
    with gate.round(steps=1, noise_multiplier=1.5) as permit:
        engine.step(permit)
        start, state = parameters(engine.model), engine.generator.get_state()
        with pytest.raises(StepNotCovered, match="reserved 1 steps; step 2"):
            engine.step(permit)
        assert same(start, parameters(engine.model)) and torch.equal(state, engine.generator.get_state())
    with pytest.raises(StepNotCovered, match="closed"):
        engine.step(permit)
    assert same(start, parameters(engine.model)) and torch.equal(state, engine.generator.get_state())
    assert client.silo(silo_id).epsilon_spent == pytest.approx(gate_epsilon(client, silo_id, [(1.5, 1)]), rel=1e-9)


def test_models_that_mix_examples_and_samplers_over_other_data_are_refused(silo) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="GroupNorm"):
        make_engine(model=nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 10)))
    client, silo_id = silo(5.0)
    engine = make_engine()
    engine.sampler.dataset_size = N - 1  # e.g. a loader that dropped a record the registration counted
    with pytest.raises(SizeMismatch, match=f"as if it had {N} .*under-charged"):
        RoundGate(client, silo_id=silo_id, sampler=engine.sampler)
    engine.sampler.dataset_size = N + 1  # e.g. another file than the one registered: the ledger's q never ran
    with pytest.raises(SizeMismatch, match=f"as if it had {N} .*over-charged"):
        RoundGate(client, silo_id=silo_id, sampler=engine.sampler)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gated_engine_runs_on_cuda(silo) -> None:  # type: ignore[no-untyped-def]
    client, silo_id = silo(5.0)
    model = SmallCNN().cuda()
    engine = DPSGDEngine(model, torch.optim.SGD(model.parameters(), lr=0.5), loss_fn=per_example_loss, data=digits(),
                         batch_size=BATCH, max_grad_norm=1.0, generator=torch.Generator("cuda").manual_seed(0))
    gate = RoundGate(client, silo_id=silo_id, sampler=engine.sampler)
    start = parameters(model)
    with gate.round(steps=2, noise_multiplier=1.5) as permit:
        engine.step(permit)
        engine.step(permit)
    assert not same(start, parameters(model)) and all(p.is_cuda for p in model.parameters())
    assert client.silo(silo_id).epsilon_spent == pytest.approx(gate_epsilon(client, silo_id, [(1.5, 2)]), rel=1e-9)
