"""IFCA / HypCluster with private cluster selection, and MR-MTL warm-started by it (Liu et al. 2022 §4–5).

The server keeps k cluster models. In a clustering round every approved silo picks the cluster
whose model has the lowest loss on its own data, trains that model with DP-SGD, and the server
averages each cluster's trained copies (Ghosh et al. 2020, IFCA; Mansour et al. 2020, HypCluster;
Liu et al. 2022 refs [33, 69]). Picking a cluster reads the silo's data, so under silo-specific
sample-level DP it is a query of its own that must be paid for (Liu et al. 2022 §3 and §4, Fig. 4: "the
privacy overhead of cluster selection").

How selection is made private, and what it is charged as: the silo draws a Poisson sample of its
records (rate q_s = B_s / n_k; B_s = n_k by default, i.e. every record, as IFCA evaluates on the
whole local dataset), computes each sampled record's vector of k losses, clips that vector to L2
norm ≤ C_ℓ (jointly, so each record's ranking of the clusters is kept), sums the vectors and adds
N(0, σ_s²C_ℓ² I_k); the argmin of the noisy sums is the cluster. One record changes the sum by at
most C_ℓ in L2, so this is exactly one Poisson-sampled Gaussian of noise multiplier σ_s, the
mechanism `dpsgd(batch_size=B_s, σ_s, steps=1)` on the ledger's wire (the shortcut names the
mechanism's shape; the service derives q_s from the silo's registered size as for any dpsgd
charge). The argmin is post-processing. Report-noisy-min with Gaussian noise was chosen over the
exponential mechanism because it maps one to one onto a dp-accounting event, so the ledger's
composition of it is exact.

A clustering round therefore costs composed(dpsgd(q, σ, E), dpsgd(q_s, σ_s, 1)), a plain round
dpsgd(q, σ, E). "IFCA (10%)" of Liu et al. 2022 Fig. 3 clusters only in the first 10% of rounds and keeps
the last assignment afterwards (reusing an already-private choice is free).

`ClusteredMRMTL` is Liu et al. 2022 §5's warm start ("IFCA 5%" in Fig. 6): IFCA for the first rounds,
then MR-MTL(λ) inside each formed cluster, each silo's model pulled towards the mean of its cluster's
personalized models, starting from its cluster's model.
"""

from __future__ import annotations

import math

import torch

from dpledger.trainer.federated.base import FederatedAlgorithm, update_norms
from dpledger.trainer.federated.config import DPSGDConfig, check_lam
from dpledger.trainer.federated.engine import SiloEngine
from dpledger.trainer.federated.halves import Arrays, Halves, ServerHalf, ServerStart, SiloHalf, Trained
from dpledger.trainer.federated.local import PERSONAL
from dpledger.trainer.federated.plan import SELECTIONS, PlannedQuery
from dpledger.trainer.federated.selection import ClusterSelection
from dpledger.trainer.federated.warm_start import PersonalAfterWarmStart

CLUSTERS, CLUSTER, ASSIGNMENT, MODEL, MEANS = "clusters", "cluster", "assignment", "model", "means"


def clustering_rounds(fraction: float, rounds: int) -> int:
    """The number of leading rounds that select clusters for "IFCA (p%)": ⌈p·R⌉, at least 1."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1]. Found {fraction}.")
    return max(1, math.ceil(fraction * rounds))


def _check_rounds(clusters: int, selection_rounds: int | None) -> None:
    if clusters < 1:
        raise ValueError(f"clusters must be at least 1. Found {clusters}.")
    if selection_rounds is not None and selection_rounds < 0:
        raise ValueError(f"selection_rounds must be >= 0 or None. Found {selection_rounds}.")


class ClusterSilo(SiloHalf):
    """In a clustering round, privately selects the received cluster model with the lowest noisy loss
    on its data (one charged query; see the module docstring); trains its cluster's model with E
    DP-SGD steps and sends it with the cluster's index. A silo that never selected is in cluster 0."""

    def __init__(self, config: DPSGDConfig, *, selection: ClusterSelection, selection_rounds: int | None) -> None:
        super().__init__(config)
        self.selection = selection
        self.selection_rounds = selection_rounds

    def selects(self, round_index: int) -> bool:
        return self.selection_rounds is None or round_index < self.selection_rounds

    def extra_queries(self, round_index: int, engine: SiloEngine, row: int) -> tuple[PlannedQuery, ...]:
        # A clustering round composes the selection with the DP-SGD steps; other rounds reuse the
        # last (already private) assignment for free.
        if not self.selects(round_index):
            return ()
        return (PlannedQuery(SELECTIONS, 1, engine.selection_mechanism(row, self.selection)),)

    def start(self, initial: torch.Tensor, rows: int) -> Arrays:
        return {ASSIGNMENT: torch.zeros(rows, dtype=torch.int64, device=initial.device)}

    def train(self, round_index: int, engine: SiloEngine, rows: torch.Tensor, received: Arrays,
              state: Arrays) -> Trained:
        if self.selects(round_index):
            state[ASSIGNMENT][rows] = engine.select(received[CLUSTERS], rows, self.selection)
        chosen = state[ASSIGNMENT][rows]
        start = received[CLUSTERS][chosen]
        trained = engine.dp_sgd(start, rows, steps=self.config.local_steps)
        return Trained({MODEL: trained, CLUSTER: chosen}, update_norms(trained - start))

    def deployed(self, received: Arrays, state: Arrays) -> torch.Tensor:
        return received[CLUSTERS][state[ASSIGNMENT]]


class ClusterServer(ServerHalf):
    """k cluster models, cluster 0 from the initial model every algorithm shares and the others from
    distinct random initialisations (IFCA's recipe); each cluster's model becomes the mean of the
    trained copies of the silos that chose it. It learns each silo's cluster from its upload."""

    def __init__(self, start: ServerStart, *, clusters: int) -> None:
        super().__init__(start)
        self.cluster_models = torch.stack([start.initial] + [start.fresh_model(j) for j in range(1, clusters)])
        self.assignment = torch.zeros(start.num_silos, dtype=torch.int64, device=start.initial.device)

    def broadcast(self, round_index: int) -> Arrays:
        return {CLUSTERS: self.cluster_models}

    def aggregate(self, round_index: int, members: torch.Tensor, upload: Arrays) -> None:
        chosen, trained = upload[CLUSTER], upload[MODEL]
        self.assignment[members] = chosen
        for cluster in torch.unique(chosen).tolist():
            self.cluster_models[cluster] = trained[chosen == cluster].mean(0)

    def state(self) -> Arrays:
        return {CLUSTERS: self.cluster_models.clone()}


class IFCA(FederatedAlgorithm):
    """k cluster models; each approved silo privately selects one in clustering rounds (see the
    module docstring), trains it with E DP-SGD steps, and the server averages each cluster's
    trained copies. Each silo deploys its cluster's model.

    `clusters`: k. `selection_rounds`: None to select in every round (IFCA's default), or the number
    of leading rounds that select (see `clustering_rounds`).
    """

    name = "ifca"
    cost = "dpsgd(B_k/n_k, σ, E) + dpsgd(B_s/n_k, σ_s, 1) in selecting rounds"
    deploys = "its cluster's model"

    @classmethod
    def halves(cls, config: DPSGDConfig, *, clusters: int, selection: ClusterSelection = ClusterSelection(),
               selection_rounds: int | None = None) -> Halves:
        _check_rounds(clusters, selection_rounds)
        return Halves(ClusterSilo(config, selection=selection, selection_rounds=selection_rounds),
                      lambda start: ClusterServer(start, clusters=clusters))


class ClusterPulledSilo(PersonalAfterWarmStart):
    """IFCA's silo half while it warms up; then its own model, pulled towards its cluster's mean."""

    def __init__(self, parent: ClusterSilo, *, warm_start_rounds: int, lam: float) -> None:
        super().__init__(parent, warm_start_rounds=warm_start_rounds)
        self.lam = lam

    def anchor(self, received: Arrays, state: Arrays, rows: torch.Tensor) -> tuple[torch.Tensor | None, float]:
        return received[MEANS][state[ASSIGNMENT][rows]], self.lam

    def personal_upload(self, state: Arrays, rows: torch.Tensor) -> Arrays:
        return {MODEL: state[PERSONAL][rows]}


class ClusterMeanServer(ClusterServer):
    """IFCA's server while it warms up; then, per cluster, the mean of its silos' latest personal
    models (a stopped silo's frozen one included; at the switch each silo's is its cluster's model)."""

    def __init__(self, start: ServerStart, *, clusters: int, warm_start_rounds: int) -> None:
        super().__init__(start, clusters=clusters)
        self.warm_start_rounds = warm_start_rounds
        self.latest: torch.Tensor | None = None

    def _cluster_means(self) -> torch.Tensor:
        """[k, P]: for each cluster, the mean of its silos' personal models (post-processing)."""
        latest = self.latest if self.latest is not None else self.cluster_models[self.assignment]
        members = torch.nn.functional.one_hot(self.assignment, len(self.cluster_models)).to(latest.dtype)  # [K, k]
        means: torch.Tensor = (members.T @ latest) / members.sum(0).clamp(min=1).unsqueeze(1)
        return means

    def broadcast(self, round_index: int) -> Arrays:
        if round_index < self.warm_start_rounds:
            return super().broadcast(round_index)
        return {CLUSTERS: self.cluster_models, MEANS: self._cluster_means()}

    def aggregate(self, round_index: int, members: torch.Tensor, upload: Arrays) -> None:
        if round_index < self.warm_start_rounds:
            super().aggregate(round_index, members, upload)
            return
        if self.latest is None:
            self.latest = self.cluster_models[self.assignment].clone()
        self.latest[members] = upload[MODEL]


class ClusteredMRMTL(FederatedAlgorithm):
    """MR-MTL(λ) warm-started by IFCA (Liu et al. 2022 §5, Fig. 6): rounds < `selection_rounds` run IFCA;
    from then on each silo trains its own model, starting from its cluster's, with
    loss_k(w_k) + λ/2‖w_k − w̄_c‖², w̄_c the mean of the personalized models of its cluster c.

    Cost: IFCA's in the warm-start rounds, then MR-MTL's dpsgd(q, σ, E) (no selection).
    """

    name = "ifca_mrmtl"
    cost = "IFCA's, then dpsgd(B_k/n_k, σ, E)"
    deploys = "cluster's, then own model"

    @classmethod
    def halves(cls, config: DPSGDConfig, *, lam: float, clusters: int, selection_rounds: int,
               selection: ClusterSelection = ClusterSelection()) -> Halves:
        check_lam(lam)
        if selection_rounds < 1:
            raise ValueError(f"selection_rounds must be at least 1 (the warm start). Found {selection_rounds}.")
        _check_rounds(clusters, selection_rounds)
        silo = ClusterPulledSilo(ClusterSilo(config, selection=selection, selection_rounds=selection_rounds),
                                 warm_start_rounds=selection_rounds, lam=lam)
        return Halves(silo, lambda start: ClusterMeanServer(start, clusters=clusters, warm_start_rounds=selection_rounds))
