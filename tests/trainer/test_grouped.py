"""Group-wise aggregation against a real ledger over HTTP: the warm-start round is charged but leaves
the global model alone (Liu et al. 2023 §4.1), the groups come from the ledger's clustering of the norms
and not from budgets, PFA projects the noisy group onto the public subspace (Liu et al. 2023 Alg. 1),
FedHDP weighs groups by r (FedHDP Alg. 2) and its quantile query is charged."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dpledger.harness import running_server
from dpledger.trainer.data.digits import make_rotated_masked_digits
from dpledger.trainer.federated import (
    PFA,
    AdaptiveClip,
    DPSGDConfig,
    FedHDP,
    GroupAggregated,
)
from dpledger.trainer.grouped import GroupedRun, issue_coordinator_key, run_grouped
from dpledger.trainer.loop import GatedSilo, RoundRecord
from dpledger.wire.client import LedgerClient
from dpledger.wire.errors import Rejected
from tests.conftest import ADMIN_KEY

CONFIG = DPSGDConfig(batch_size=16, local_steps=2, seed=5)
# Three silos with little noise, five with a lot: two privacy groups, as MixGauss1's two components.
NOISE = [0.3, 0.3, 0.3, 6.0, 6.0, 6.0, 6.0, 6.0]
NOISE_GROUPS = [0, 0, 0, 1, 1, 1, 1, 1]


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = f"sqlite:///{tmp_path_factory.mktemp('grouped')}/ledger.db"
    with running_server(database_url=url, admin_key=ADMIN_KEY) as base:
        yield base


@pytest.fixture(scope="module")
def coordinator(ledger: str) -> Iterator[LedgerClient]:
    with LedgerClient(ledger, ADMIN_KEY) as admin, LedgerClient(ledger, issue_coordinator_key(admin)) as client:
        yield client


def common() -> dict[str, Any]:
    data = make_rotated_masked_digits(n_silos=len(NOISE), seed=2)
    return {
        "x_train": [s.x_train for s in data.silos], "y_train": [s.y_train for s in data.silos],
        "x_test": [s.x_test for s in data.silos], "y_test": [s.y_test for s in data.silos],
        "num_classes": 10, "config": CONFIG, "noise_multipliers": NOISE,
    }


def register(url: str, algorithm: GroupAggregated, budgets: list[float], prefix: str) -> list[GatedSilo]:
    with LedgerClient(url, ADMIN_KEY) as admin:
        created = [
            admin.create_silo(name=f"{prefix}-{k}", epsilon=b, delta=1e-5, dataset_size=algorithm.train.sizes[k])
            for k, b in enumerate(budgets)
        ]
    return [GatedSilo(c.id, LedgerClient(url, c.api_key)) for c in created]


def run(url: str, coordinator: LedgerClient, algorithm: GroupAggregated, prefix: str, *, rounds: int = 2,
        budgets: list[float] | None = None, groups: list[int] | None = None,
        watch: list[torch.Tensor] | None = None) -> tuple[GroupedRun, list[GatedSilo]]:
    silos = register(url, algorithm, budgets or [1000.0] * len(NOISE), prefix)

    def snapshot(record: RoundRecord) -> None:
        if watch is not None:
            watch.append(algorithm.server.global_model.clone())

    return run_grouped(algorithm, silos, coordinator=coordinator, rounds=rounds, name=prefix, groups=groups,
                       on_round=snapshot), silos


def test_the_warm_start_round_charges_every_silo_and_leaves_the_global_model(ledger: str, coordinator: LedgerClient) -> None:
    algorithm = PFA(**common())
    initial = algorithm.server.global_model.clone()
    globals_after: list[torch.Tensor] = []
    result, silos = run(ledger, coordinator, algorithm, "warm", rounds=3, watch=globals_after)

    assert result.run is not None and result.run.approved_rounds() == [3] * len(NOISE)
    assert torch.equal(globals_after[0], initial)  # round 0: collected, not aggregated
    assert not torch.equal(globals_after[1], initial) and not torch.equal(globals_after[2], globals_after[1])
    for silo in silos:
        reserves = [e for e in silo.client.history(silo.silo_id) if e.event == "reserve"]
        assert [(e.round, e.mechanism["type"], e.mechanism["steps"]) for e in reserves if e.mechanism] == [
            (0, "dpsgd", CONFIG.local_steps), (1, "dpsgd", CONFIG.local_steps), (2, "dpsgd", CONFIG.local_steps)
        ]
        assert silo.client.silo(silo.silo_id).epsilon_committed > 0.0


def test_groups_come_from_the_ledger_and_the_coordinator_sees_no_budget(ledger: str, coordinator: LedgerClient) -> None:
    algorithm = PFA(**common())
    result, silos = run(ledger, coordinator, algorithm, "fromledger")

    assert result.source == "norms"
    assert result.service_groups == coordinator.groups(result.job_id, 0)
    assert result.groups == [result.service_groups[s.silo_id] for s in silos] == NOISE_GROUPS
    assert algorithm.groups is not None and algorithm.groups.tolist() == NOISE_GROUPS
    with pytest.raises(Rejected) as refused:
        coordinator.silo(silos[0].silo_id)
    assert refused.value.status_code == 404  # the strict gate: not even the silo's existence is told


def test_different_budgets_with_the_same_norms_give_the_same_groups(ledger: str, coordinator: LedgerClient) -> None:
    # The second ledger entry gives the low-noise silos the *smallest* budgets: grouping by budget
    # would make silos 3-7 the public group; grouping by norm cannot see the difference.
    inverted = [100.0, 150.0, 120.0, 900.0, 1000.0, 800.0, 950.0, 990.0]
    runs = []
    for prefix, budgets in (("same-a", [1000.0] * len(NOISE)), ("same-b", inverted)):
        result, _ = run(ledger, coordinator, PFA(**common()), prefix, budgets=budgets)
        assert result.run is not None
        runs.append(result)
    first, second = runs[0].run, runs[1].run
    assert first is not None and second is not None
    assert first.rounds[0].update_norms == second.rounds[0].update_norms
    assert runs[0].groups == runs[1].groups == NOISE_GROUPS


def test_explicit_groups_are_used_as_given(ledger: str, coordinator: LedgerClient) -> None:
    explicit = [1, 1, 1, 0, 0, 0, 0, 0]
    algorithm = PFA(**common())
    result, _ = run(ledger, coordinator, algorithm, "explicit", groups=explicit)
    assert result.source == "explicit" and result.groups == explicit
    assert list(result.service_groups.values()) == NOISE_GROUPS  # still reported, for comparison
    assert algorithm.groups is not None and algorithm.groups.tolist() == explicit


def test_pfa_projects_the_noisy_group_onto_the_public_updates(ledger: str, coordinator: LedgerClient) -> None:
    algorithm = PFA(**common())
    initial = algorithm.server.global_model.clone()
    run(ledger, coordinator, algorithm, "pfa")
    updates = (algorithm.silo_state["local"] - initial).to(torch.float64)
    public = torch.tensor(NOISE_GROUPS) == 0
    n = len(NOISE)
    private_part = (algorithm.server.global_model - initial).to(torch.float64) - (3 / n) * updates[public].mean(0)
    # k = full rank of the 3 public updates: the private contribution lies in their span...
    q, _ = torch.linalg.qr(updates[public].T)
    residual = private_part - q @ (q.T @ private_part)
    assert residual.norm() < 1e-4 * private_part.norm()
    # ...and is exactly the projection of the private mean there, which has most of its mass outside.
    private_mean = updates[~public].mean(0)
    assert torch.allclose(private_part, (5 / n) * q @ (q.T @ private_mean), atol=1e-5)
    assert (private_mean - q @ (q.T @ private_mean)).norm() > 0.9 * private_mean.norm()


@pytest.mark.parametrize("ratio", [1.0, 0.0])
def test_fedhdp_ratio_one_is_the_plain_mean_and_zero_the_public_mean(
    ledger: str, coordinator: LedgerClient, ratio: float
) -> None:
    algorithm = FedHDP(ratio=ratio, **common())
    initial = algorithm.server.global_model.clone()
    run(ledger, coordinator, algorithm, f"hdp-{ratio}")
    updates = algorithm.silo_state["local"] - initial
    expected = updates.mean(0) if ratio == 1.0 else updates[:3].mean(0)
    assert torch.allclose(algorithm.server.global_model - initial, expected, atol=1e-6)
    assert algorithm.server.ratio_history == [[1.0, ratio]]


def test_fedhdp_budget_blind_ratio_downweights_the_noisy_group(ledger: str, coordinator: LedgerClient) -> None:
    algorithm = FedHDP(ratio="budget_blind", **common())
    run(ledger, coordinator, algorithm, "hdp-blind", rounds=3)
    for r0, r1 in algorithm.server.ratio_history:
        assert r0 == 1.0 and 0.0 < r1 < 0.1  # noise σ 6 vs 0.3: the noisy silos' variance is far larger


def test_fedhdp_quantile_query_is_charged_as_its_own_mechanism(ledger: str, coordinator: LedgerClient) -> None:
    clip = AdaptiveClip(initial_clip=1.0, noise_multiplier=2.0, target_quantile=0.5, learning_rate=0.2)
    algorithm = FedHDP(ratio=0.5, adaptive_clip=clip, **common())
    result, silos = run(ledger, coordinator, algorithm, "hdp-quantile", rounds=3)
    assert result.run is not None and result.run.approved_rounds() == [3] * len(NOISE)
    for silo in silos:
        reserves = [e for e in silo.client.history(silo.silo_id) if e.event == "reserve"]
        mechanisms = [e.mechanism for e in reserves]
        assert mechanisms[0]["type"] == "dpsgd"  # warm-start round: no aggregation, no query
        for m in mechanisms[1:]:
            assert m["type"] == "composed"
            assert [e["type"] for e in m["events"]] == ["dpsgd", "gaussian"]
            assert m["events"][1]["noise_multiplier"] == 2.0
    # Round 1 ran at S = 1; the query moved S for round 2 (half the norms are ≫ 1, half ≤ ~1).
    assert algorithm.server.clip_history[0] == 1.0 and algorithm.server.clip_history[1] != 1.0


def test_an_aggregation_round_without_groups_touches_no_data() -> None:
    algorithm = PFA(**common())
    with pytest.raises(RuntimeError, match="set_groups"):
        algorithm.run_round(1, torch.ones(len(NOISE), dtype=torch.bool))
    assert int(algorithm._queries.sum()) == 0
