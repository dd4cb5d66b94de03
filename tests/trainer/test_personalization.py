"""IFCA with charged cluster selection, local finetuning and warm-started MR-MTL (Liu et al. 2022 §4–5)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dpledger.harness import running_server
from dpledger.trainer.data.digits import make_rotated_masked_digits
from dpledger.trainer.federated import (
    IFCA,
    ClusteredMRMTL,
    ClusterSelection,
    Ditto,
    DPSGDConfig,
    FedAvg,
    FederatedAlgorithm,
    Finetuning,
    clustering_rounds,
)
from dpledger.trainer.federated.engine import SiloEngine
from dpledger.trainer.federated.halves import Arrays, Halves, Trained
from dpledger.trainer.federated.ifca import ClusterSilo
from dpledger.trainer.federated.plan import SELECTIONS
from dpledger.trainer.loop import GatedSilo, RoundRecord, run_gated
from dpledger.wire.client import LedgerClient
from tests.conftest import ADMIN_KEY
from tests.gate_oracle import budget_admitting, dpsgd_epsilon
from tests.trainer import wire

CONFIG = DPSGDConfig(batch_size=16, local_steps=3, noise_multiplier=1.2, seed=2)
DELTA = 1e-5
ALL = torch.ones


def digits_args(silos: int, *, seed: int = 0, config: DPSGDConfig = CONFIG) -> tuple[dict[str, Any], list[int]]:
    data = make_rotated_masked_digits(n_silos=silos, seed=seed, mask_probability=0.1)
    args = dict(
        **data.tensors(), num_classes=10, config=config,
    )
    return args, [s.group for s in data.silos]


def run_ungated(algorithm: FederatedAlgorithm, rounds: int) -> None:
    for r in range(rounds):
        algorithm.run_round(r, ALL(algorithm.num_silos, dtype=torch.bool))


def purity(assignment: list[int], groups: list[int]) -> float:
    """Share of silos whose cluster's majority rotation group is their own."""
    agree = 0
    for cluster in set(assignment):
        members = [g for a, g in zip(assignment, groups, strict=True) if a == cluster]
        agree += Counter(members).most_common(1)[0][1]
    return agree / len(groups)


# ----- the algorithms, without a ledger -----------------------------------------------------------


def test_ifca_selection_recovers_the_rotation_clusters() -> None:
    args, groups = digits_args(20, config=DPSGDConfig(seed=0))
    ifca = IFCA(clusters=4, **args)
    run_ungated(ifca, 12)
    assignment = ifca.silo_state["assignment"].tolist()
    assert purity(assignment, groups) == 1.0
    assert len(set(assignment)) == 4
    # Each silo deploys its own cluster's model, and the clusters are distinct models.
    assert torch.equal(ifca.deployed_parameters(), ifca.server.cluster_models[ifca.silo_state["assignment"]])
    assert torch.linalg.matrix_rank(ifca.server.cluster_models) == 4


def test_selection_noise_is_what_separates_private_from_exact_selection() -> None:
    """With vanishing σ_s the noisy argmin is the exact argmin of the clipped loss sums; with a
    huge σ_s the choice is noise (a sanity check that the noise is really added)."""
    args, _groups = digits_args(8)
    selection = ClusterSelection(noise_multiplier=1e-9)
    exact = IFCA(clusters=4, selection=selection, **args)
    run_ungated(exact, 4)
    silos = torch.arange(8)
    losses = []
    for k in range(8):
        x, y = exact.train.x[k, : exact.train.sizes[k]], exact.train.y[k, : exact.train.sizes[k]]
        per = torch.stack(
            [torch.nn.functional.cross_entropy(exact.model.forward(m, x), y, reduction="none")
             for m in exact.server.cluster_models], 1
        )
        factor = (
            selection.loss_clip / torch.linalg.vector_norm(per, dim=1).clamp(min=selection.loss_clip)
        ).unsqueeze(1)
        losses.append((per * factor).sum(0))
    expected = torch.stack(losses).argmin(1)
    assert torch.equal(exact.engine.select(exact.server.cluster_models, silos, selection), expected)

    loud = ClusterSelection(noise_multiplier=1e6)
    noisy = IFCA(clusters=4, selection=loud, **args)
    picks = torch.cat([noisy.engine.select(noisy.server.cluster_models, silos, loud) for _ in range(50)])
    assert set(picks.tolist()) == {0, 1, 2, 3}


def test_ifca_declares_selection_only_in_selecting_rounds() -> None:
    args, _ = digits_args(4)
    ifca = IFCA(clusters=3, selection_rounds=2, **args)
    dpsgd = {"type": "dpsgd", "batch_size": 16, "noise_multiplier": CONFIG.noise_multiplier, "steps": CONFIG.local_steps}
    for r in (0, 1):
        for k, mechanism in enumerate(wire(ifca.round_mechanisms(r))):
            selection = {"type": "dpsgd", "batch_size": ifca.train.sizes[k], "noise_multiplier": 1.0, "steps": 1}
            assert mechanism == {"type": "composed", "events": [dpsgd, selection]}
    assert wire(ifca.round_mechanisms(2)) == [dpsgd] * 4
    assert clustering_rounds(0.1, 40) == 4 and clustering_rounds(0.05, 10) == 1 and clustering_rounds(1.0, 7) == 7
    with pytest.raises(ValueError, match="fraction"):
        clustering_rounds(0.0, 10)


def test_a_refused_silo_neither_selects_nor_trains() -> None:
    args, _ = digits_args(4)
    ifca = IFCA(clusters=2, **args)
    approved = torch.tensor([True, False, True, True])
    before = ifca.state()
    result = ifca.run_round(0, approved)
    assert ifca.meter.total(SELECTIONS).tolist() == [1, 0, 1, 1]
    assert result.steps.tolist() == [CONFIG.local_steps, 0, CONFIG.local_steps, CONFIG.local_steps]
    assert int(ifca.silo_state["assignment"][1]) == int(before["assignment"][1]) == 0


class _SelectingSilo(ClusterSilo):
    def train(self, round_index: int, engine: SiloEngine, rows: torch.Tensor, received: Arrays,
              state: Arrays) -> Trained:
        engine.select(received["clusters"], rows, self.selection)  # a query its `queries` never declared
        return super().train(round_index, engine, rows, received, state)


class _SelectsWithoutDeclaring(IFCA):
    @classmethod
    def halves(cls, config: DPSGDConfig, *, clusters: int, selection_rounds: int | None = None) -> Halves:
        server = IFCA.halves(config, clusters=clusters, selection_rounds=selection_rounds).server
        return Halves(_SelectingSilo(config, selection=ClusterSelection(), selection_rounds=selection_rounds), server)


def test_a_selection_that_was_not_declared_fails_the_round() -> None:
    args, _ = digits_args(4)
    sneaky = _SelectsWithoutDeclaring(clusters=2, selection_rounds=0, **args)
    assert wire(sneaky.round_mechanisms(0))[0]["type"] == "dpsgd"  # declares no selection
    with pytest.raises(RuntimeError, match="selections run"):
        sneaky.run_round(0, ALL(4, dtype=torch.bool))


def test_finetuning_is_fedavg_until_it_switches_then_local() -> None:
    args, _ = digits_args(6)
    finetune, fedavg = Finetuning(federated_rounds=3, **args), FedAvg(**args)
    run_ungated(finetune, 3)
    run_ungated(fedavg, 3)
    assert torch.equal(finetune.server.global_model, fedavg.server.global_model)
    assert torch.equal(finetune.deployed_parameters(), fedavg.deployed_parameters())
    finetune.run_round(3, ALL(6, dtype=torch.bool))
    deployed = finetune.deployed_parameters()
    assert torch.equal(finetune.server.global_model, fedavg.server.global_model)  # the global model stops
    assert all(not torch.equal(deployed[0], deployed[k]) for k in range(1, 6))  # each silo its own
    assert wire(finetune.round_mechanisms(3)) == wire(fedavg.round_mechanisms(3))  # finetuning steps are charged


def test_warm_started_mrmtl_starts_each_silo_from_its_cluster_model() -> None:
    args, _ = digits_args(8)
    warm = ClusteredMRMTL(lam=0.5, clusters=4, selection_rounds=2, **args)
    run_ungated(warm, 2)
    clusters, assignment = warm.server.cluster_models.clone(), warm.silo_state["assignment"].clone()
    assert torch.equal(warm.deployed_parameters(), clusters[assignment])
    warm.run_round(2, ALL(8, dtype=torch.bool))
    assert warm.silo_state["switched"].all()
    assert torch.equal(warm.silo_state["assignment"], assignment)  # no selection after the warm start
    assert warm.meter.total(SELECTIONS).tolist() == [2] * 8
    # The pull towards the cluster's mean: after a few rounds the models of one cluster are closer
    # to each other than to any model of another cluster.
    warm_small = ClusteredMRMTL(lam=0.5, clusters=4, selection_rounds=2, **args)
    run_ungated(warm_small, 6)
    personal = warm_small.silo_state["personal"]
    same, other = [], []
    for i in range(8):
        for j in range(i + 1, 8):
            d = float(torch.linalg.vector_norm(personal[i] - personal[j]))
            (same if warm_small.silo_state["assignment"][i] == warm_small.silo_state["assignment"][j] else other).append(d)
    assert same and other and max(same) < min(other)


# ----- charged ε == dp-accounting's composition of the queries made -------------------------------


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = f"sqlite:///{tmp_path_factory.mktemp('personalization')}/ledger.db"
    with running_server(database_url=url, admin_key=ADMIN_KEY) as base:
        yield base


def dpsgd_round(algorithm: FederatedAlgorithm, k: int) -> dict[str, Any]:
    """Silo k's plain round (CONFIG's DP-SGD steps), as a silo declares its expected workload."""
    return {"type": "dpsgd", "noise_multiplier": CONFIG.noise_multiplier, "batch_size": algorithm.batch_sizes[k],
            "steps": CONFIG.local_steps}


def gated_silos(
    url: str, algorithm: FederatedAlgorithm, prefix: str, epsilon: float, *, horizons: bool = False
) -> list[GatedSilo]:
    with LedgerClient(url, ADMIN_KEY) as admin:
        created = [
            admin.create_silo(name=f"{prefix}-{k}", epsilon=epsilon, delta=DELTA, dataset_size=n,
                              horizon=dpsgd_round(algorithm, k) if horizons else None)
            for k, n in enumerate(algorithm.train.sizes)
        ]
    return [GatedSilo(c.id, LedgerClient(url, c.api_key)) for c in created]


def queries_per_round(algorithm: FederatedAlgorithm, url: str, prefix: str, rounds: int, epsilon: float = 1e3,
                      *, horizons: bool = False):
    """Runs the algorithm gated by the ledger; returns the run, per round and silo the DP-SGD steps
    and selection queries the algorithm actually made (read off its own counters), and each silo as
    the ledger describes it after the run (its filter: tests/gate_oracle.py)."""
    made: list[tuple[list[int], list[int]]] = []
    last = [
        algorithm._queries.clone(),
        algorithm.meter.total(SELECTIONS).clone(),
    ]

    def snapshot(_: RoundRecord) -> None:
        now = [algorithm._queries.clone(), algorithm.meter.total(SELECTIONS).clone()]
        made.append(((now[0] - last[0]).tolist(), (now[1] - last[1]).tolist()))
        last[:] = now

    silos = gated_silos(url, algorithm, prefix, epsilon, horizons=horizons)
    try:
        run = run_gated(algorithm, silos, rounds=rounds, job_id=prefix, on_round=snapshot)
        details = [silo.client.silo(silo.silo_id) for silo in silos]
    finally:
        for silo in silos:
            silo.client.close()
    return run, made, details


def selection_rate(selection: ClusterSelection, n: int) -> float:
    return (n if selection.batch_size is None else min(selection.batch_size, n)) / n


def independent_epsilons(algorithm: FederatedAlgorithm, made, selection: ClusterSelection | None, silos) -> list[list[float]]:  # type: ignore[no-untyped-def]
    """ε of each silo after each round, given the queries made: dp-accounting's curves of the DP-SGD
    steps and the selections (each one Poisson-sampled Gaussian), composed by adding them and read
    through the silo's published filter."""
    out = []
    runs: list[list[tuple[float, float, int]]] = [[] for _ in range(algorithm.num_silos)]
    for steps, selections in made:
        for k in range(algorithm.num_silos):
            q = algorithm.batch_sizes[k] / algorithm.train.sizes[k]
            runs[k].append((q, CONFIG.noise_multiplier, steps[k]))
            if selections[k]:
                assert selection is not None
                q_s = selection_rate(selection, algorithm.train.sizes[k])
                runs[k].append((q_s, selection.noise_multiplier, selections[k]))
        out.append([dpsgd_epsilon(silos[k], runs[k], delta=DELTA) for k in range(algorithm.num_silos)])
    return out


SELECTION = ClusterSelection(noise_multiplier=2.0, loss_clip=4.0, batch_size=24)


@pytest.mark.parametrize(
    "method",
    ["ifca", "ifca_10pct", "ifca_mrmtl", "finetune", "ditto", "fedavg"],
)
def test_charged_epsilon_equals_the_composition_of_the_queries_made(ledger: str, method: str) -> None:
    args, _ = digits_args(3, seed=1)
    rounds = 4
    algorithm: FederatedAlgorithm = {
        "ifca": lambda: IFCA(clusters=2, selection=SELECTION, **args),
        "ifca_10pct": lambda: IFCA(clusters=2, selection=SELECTION, selection_rounds=clustering_rounds(0.1, rounds), **args),
        "ifca_mrmtl": lambda: ClusteredMRMTL(lam=0.5, clusters=2, selection=SELECTION, selection_rounds=2, **args),
        "finetune": lambda: Finetuning(federated_rounds=2, **args),
        "ditto": lambda: Ditto(lam=0.5, personal_steps=2, **args),
        "fedavg": lambda: FedAvg(**args),
    }[method]()
    run, made, silos = queries_per_round(algorithm, ledger, f"eps-{method}", rounds)
    assert run.stop_reason is None and len(run.rounds) == rounds
    expected = independent_epsilons(algorithm, made, SELECTION, silos)
    for r, record in enumerate(run.rounds):
        for k in range(algorithm.num_silos):
            assert record.epsilon_spent[k] == pytest.approx(expected[r][k], rel=1e-9), (method, r, k)

    selecting = {"ifca": rounds, "ifca_10pct": 1, "ifca_mrmtl": 2}.get(method, 0)
    assert [sum(s) for _, s in made] == [algorithm.num_silos if r < selecting else 0 for r in range(rounds)]
    steps_per_round = CONFIG.local_steps + (2 if method == "ditto" else 0)
    assert all(s == [steps_per_round] * algorithm.num_silos for s, _ in made)


def test_a_selecting_round_costs_more_than_a_plain_one_by_the_selection(ledger: str) -> None:
    args, _ = digits_args(2, seed=1)
    ifca = IFCA(clusters=2, selection=SELECTION, selection_rounds=1, **args)
    run, _, silos = queries_per_round(ifca, ledger, "eps-step", 2)
    first, second = run.rounds[0].epsilon_spent[0], run.rounds[1].epsilon_spent[0]
    plain_round = second - first
    assert first > plain_round > 0  # round 0 paid dpsgd + selection, round 1 dpsgd alone

    # In RDP, where composition is additive, the difference is exactly the selection's curve.
    q = ifca.batch_sizes[0] / ifca.train.sizes[0]
    q_s = selection_rate(SELECTION, ifca.train.sizes[0])
    step = (q, CONFIG.noise_multiplier, CONFIG.local_steps)
    selection = (q_s, SELECTION.noise_multiplier, 1)
    assert first == pytest.approx(dpsgd_epsilon(silos[0], [step, selection], delta=DELTA), rel=1e-9)
    assert first > dpsgd_epsilon(silos[0], [step], delta=DELTA)


def test_ifca_every_round_runs_out_of_budget_before_ifca_10pct(ledger: str) -> None:
    """Liu et al. 2022 Fig. 4: at one budget, selecting every round buys fewer rounds than selecting
    only at the start. The budget fits 6 plain rounds plus one selection."""
    args, _ = digits_args(2, seed=1)
    rounds = 8
    probe = IFCA(clusters=2, selection=SELECTION, **args)
    q = probe.batch_sizes[0] / probe.train.sizes[0]
    q_s = selection_rate(SELECTION, probe.train.sizes[0])
    assert probe.train.sizes[0] == probe.train.sizes[1] and probe.batch_sizes[0] == probe.batch_sizes[1]

    def once(plain_rounds: int) -> list[tuple[float, float, int]]:
        return [(q, CONFIG.noise_multiplier, plain_rounds * CONFIG.local_steps), (q_s, SELECTION.noise_multiplier, 1)]

    # The budget that admits 6 rounds with one selection and not 7: a fixed point of budget and
    # filter (tests/gate_oracle.py), found on probe silos that declare a plain round as horizon.
    tries = iter(range(100))
    with LedgerClient(ledger, ADMIN_KEY) as admin:

        def make(budget: float) -> Any:
            made = admin.create_silo(name=f"budget-probe-{next(tries)}", epsilon=budget, delta=DELTA,
                                     dataset_size=probe.train.sizes[0], horizon=dpsgd_round(probe, 0))
            return admin.silo(made.id)

        budget = budget_admitting(make, once(6), once(7), delta=DELTA).epsilon

    every, _, every_silos = queries_per_round(
        IFCA(clusters=2, selection=SELECTION, **args), ledger, "budget-every", rounds, budget, horizons=True
    )
    once_run, _, once_silos = queries_per_round(
        IFCA(clusters=2, selection=SELECTION, selection_rounds=1, **args), ledger, "budget-once", rounds, budget, horizons=True
    )
    assert once_run.approved_rounds() == [6, 6]
    assert all(n < 6 for n in every.approved_rounds())
    assert all(once_run.stopped) and all(every.stopped)
    # Selecting every round, the sixth round's selections alone overflow it (by the same filter).
    every_six = [(q, CONFIG.noise_multiplier, 6 * CONFIG.local_steps), (q_s, SELECTION.noise_multiplier, 6)]
    assert all(dpsgd_epsilon(s, every_six, delta=DELTA) > budget for s in every_silos)
    assert all(s.filter == once_silos[0].filter for s in [*every_silos, *once_silos])


def test_train_runs_warm_started_mrmtl_and_charges_selection_only_while_clustering(ledger: str, tmp_path, monkeypatch) -> None:
    from dpledger.worker_cli import main

    with LedgerClient(ledger, ADMIN_KEY) as admin:
        sizes = [s.n_train for s in make_rotated_masked_digits(n_silos=2, seed=0, mask_probability=0.1).silos]
        created = [
            admin.create_silo(name=f"train-ifca-{k}", epsilon=50.0, delta=DELTA, dataset_size=n) for k, n in enumerate(sizes)
        ]
    config = tmp_path / "job.toml"
    config.write_text(
        f'url = "{ledger}"\njob_id = "warm"\nalgorithm = "ifca_mrmtl"\nrounds = 3\nclusters = 2\ncluster_fraction = 0.5\n'
        "[data]\nsilos = 2\n[dpsgd]\nlocal_steps = 2\n"
        + "".join(f'[[silos]]\nid = {c.id}\nkey_env = "KEY_{k}"\n' for k, c in enumerate(created))
    )
    for k, c in enumerate(created):
        monkeypatch.setenv(f"KEY_{k}", c.api_key)
    assert main(["train", str(config)]) == 0
    with LedgerClient(ledger, created[0].api_key) as silo:
        history = silo.history(created[0].id)
    kinds = [e.mechanism["type"] for e in history if e.event == "reserve" and e.mechanism]
    assert kinds == ["composed", "composed", "dpsgd"]  # ⌈0.5·3⌉ = 2 selecting rounds, then MR-MTL
