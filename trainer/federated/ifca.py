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
from dataclasses import dataclass
from typing import Any, Unpack

import torch
from torch.func import vmap

from dpledger.trainer.dpsgd.clip import clip_factors
from dpledger.trainer.dpsgd.sampler import PoissonSampler
from dpledger.trainer.federated.base import AlgorithmArgs, FederatedAlgorithm, update_norms
from dpledger.trainer.federated.batched import gaussian_noise, pad_batches
from dpledger.trainer.federated.config import (
    STREAM_INIT,
    check_lam,
    derive_seed,
    make_generator,
)
from dpledger.trainer.federated.models import make_template
from dpledger.trainer.federated.plan import SELECTIONS, PlannedQuery
from dpledger.trainer.federated.warm_start import PersonalAfterWarmStart

# Random streams of their own (0–4 are taken in trainer.federated.config and .fedhdp), so that
# enabling selection never shifts DP-SGD's draws.
STREAM_SELECTION_SAMPLER = 5
STREAM_SELECTION_NOISE = 6


@dataclass(frozen=True, kw_only=True)
class ClusterSelection:
    """The private selection's knobs: σ_s, the clip C_ℓ of each record's k-vector of losses, and
    the expected sample size B_s (None: every record, q_s = 1)."""

    # σ_s = 1 forms the four rotation clusters of 20 digits silos within ~6 rounds; σ_s = 2 needs
    # ~10 and σ_s = 5 over 20 (measured, seeds 0-2), at a quarter and a 25th of the RDP cost.
    noise_multiplier: float = 1.0
    loss_clip: float = 5.0
    batch_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("noise_multiplier", "loss_clip"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"selection {name} must be finite and > 0. Found {value}.")
        if self.batch_size is not None and self.batch_size <= 0:
            raise ValueError(f"selection batch_size must be positive. Found {self.batch_size}.")


def clustering_rounds(fraction: float, rounds: int) -> int:
    """The number of leading rounds that select clusters for "IFCA (p%)": ⌈p·R⌉, at least 1."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1]. Found {fraction}.")
    return max(1, math.ceil(fraction * rounds))


class IFCA(FederatedAlgorithm):
    """k cluster models; each approved silo privately selects one in clustering rounds (see the
    module docstring), trains it with E DP-SGD steps, and the server averages each cluster's
    trained copies. Each silo deploys its cluster's model.

    `clusters`: k. `selection_rounds`: None to select in every round (IFCA's default), or the number
    of leading rounds that select (see `clustering_rounds`). The cluster models start from distinct
    random initialisations (IFCA's recipe), cluster 0 from the initial model every algorithm shares.
    A silo that never selected (refused from the start) is counted in cluster 0.
    """

    name = "ifca"
    cost = "dpsgd(B_k/n_k, σ, E) + dpsgd(B_s/n_k, σ_s, 1) in selecting rounds"
    deploys = "its cluster's model"

    def __init__(
        self,
        *,
        clusters: int,
        selection: ClusterSelection = ClusterSelection(),
        selection_rounds: int | None = None,
        **common: Unpack[AlgorithmArgs],
    ) -> None:
        if clusters < 1:
            raise ValueError(f"clusters must be at least 1. Found {clusters}.")
        if selection_rounds is not None and selection_rounds < 0:
            raise ValueError(f"selection_rounds must be >= 0 or None. Found {selection_rounds}.")
        super().__init__(**common)
        self.clusters = clusters
        self.selection = selection
        self.selection_rounds = selection_rounds
        model = common.get("model", "mlp")
        out_features = int(self.model.forward(self.initial, self.train.x[0, :1]).shape[-1])
        inits = [self.initial] + [
            make_template(
                model, task=self.task, in_features=int(self.train.x.shape[-1]), out_features=out_features,
                init_seed=derive_seed(self.config.seed, STREAM_INIT, j), device=self.device,
            ).initial()
            for j in range(1, clusters)
        ]
        self.cluster_models = torch.stack(inits)
        self.assignment = torch.zeros(self.num_silos, dtype=torch.int64, device=self.device)
        self.selection_samplers = [
            PoissonSampler(
                dataset_size=n,
                batch_size=n if selection.batch_size is None else min(selection.batch_size, n),
                generator=make_generator(derive_seed(self.config.seed, STREAM_SELECTION_SAMPLER, k), self.device),
            )
            for k, n in enumerate(self.train.sizes)
        ]
        self.selection_generators = [
            make_generator(derive_seed(self.config.seed, STREAM_SELECTION_NOISE, k), self.device)
            for k in range(self.num_silos)
        ]

    # ----- what each round declares -------------------------------------------------------------

    def selects(self, round_index: int) -> bool:
        return self.selection_rounds is None or round_index < self.selection_rounds

    def selection_mechanism(self, silo: int) -> dict[str, Any]:
        """The selection of silo `silo` as a ledger mechanism: one Poisson-sampled Gaussian."""
        return self.selection_samplers[silo].mechanism(noise_multiplier=self.selection.noise_multiplier, steps=1)

    def extra_queries(self, round_index: int, silo: int) -> tuple[PlannedQuery, ...]:
        # A clustering round composes the selection with the DP-SGD steps; other rounds reuse the
        # last (already private) assignment for free.
        return (PlannedQuery(SELECTIONS, 1, self.selection_mechanism(silo)),) if self.selects(round_index) else ()

    @property
    def selection_queries(self) -> torch.Tensor:
        """int64 [K]: selections each silo has run on its data so far."""
        return self.meter.total(SELECTIONS)

    # ----- training -----------------------------------------------------------------------------

    def _select(self, silos: torch.Tensor) -> torch.Tensor:
        """Each silo's privately selected cluster (int64 [A]); one selection query per silo."""
        silo_list = silos.tolist()
        idx, mask = pad_batches([self.selection_samplers[k].sample() for k in silo_list], device=self.device)
        self.meter.record(SELECTIONS, silos)
        rows = silos.unsqueeze(1)
        x, y = self.train.x[rows, idx], self.train.y[rows, idx]
        per_record = vmap(self.model.example_loss, in_dims=(None, 0, 0))  # over records → [b]
        per_cluster = vmap(per_record, in_dims=(0, None, None))  # over cluster models → [k, b]
        with torch.no_grad():
            losses = vmap(per_cluster, in_dims=(None, 0, 0))(self.cluster_models, x, y).transpose(1, 2)  # [A, b, k]
            clip = self.selection.loss_clip
            factors = torch.where(mask, clip_factors(torch.linalg.vector_norm(losses, dim=-1), max_grad_norm=clip), 0.0)
            sums = torch.einsum("abk,ab->ak", losses, factors)
            noise = gaussian_noise(
                [self.selection_generators[k] for k in silo_list], size=self.clusters, std=1.0, device=self.device
            )
            return torch.argmin(sums + noise * (self.selection.noise_multiplier * clip), dim=1)

    def _train_clusters(self, round_index: int, silos: torch.Tensor) -> torch.Tensor:
        """IFCA's round: select (in clustering rounds), train the chosen cluster model, average per
        cluster over the approved silos; returns the update norms."""
        if self.selects(round_index):
            self.assignment[silos] = self._select(silos)
        chosen = self.assignment[silos]
        start = self.cluster_models[chosen]
        trained = self._dp_sgd(start, silos, steps=self.config.local_steps)
        for cluster in torch.unique(chosen).tolist():
            self.cluster_models[cluster] = trained[chosen == cluster].mean(0)
        return update_norms(trained - start)

    def _train(self, round_index: int, silos: torch.Tensor) -> torch.Tensor:
        return self._train_clusters(round_index, silos)

    def deployed_parameters(self) -> torch.Tensor:
        return self.cluster_models[self.assignment]

    def state(self) -> dict[str, torch.Tensor]:
        return {"clusters": self.cluster_models.clone(), "assignment": self.assignment.clone()}


class ClusteredMRMTL(PersonalAfterWarmStart, IFCA):
    """MR-MTL(λ) warm-started by IFCA (Liu et al. 2022 §5, Fig. 6): rounds < `selection_rounds` run IFCA;
    from then on each silo trains its own model, starting from its cluster's, with
    loss_k(w_k) + λ/2‖w_k − w̄_c‖², w̄_c the mean of the personalized models of its cluster c.

    Cost: IFCA's in the warm-start rounds, then MR-MTL's dpsgd(q, σ, E) (no selection).
    """

    name = "ifca_mrmtl"
    cost = "IFCA's, then dpsgd(B_k/n_k, σ, E)"
    deploys = "cluster's, then own model"

    def __init__(
        self,
        *,
        lam: float,
        clusters: int,
        selection_rounds: int,
        selection: ClusterSelection = ClusterSelection(),
        **common: Unpack[AlgorithmArgs],
    ) -> None:
        self.lam = check_lam(lam)
        if selection_rounds < 1:
            raise ValueError(f"selection_rounds must be at least 1 (the warm start). Found {selection_rounds}.")
        super().__init__(clusters=clusters, selection=selection, selection_rounds=selection_rounds, **common)
        self.warm_start_rounds = selection_rounds

    def _cluster_means(self) -> torch.Tensor:
        """[K, P]: for each silo, the mean of the personalized models in its cluster (post-processing)."""
        assert self.personal is not None
        members = torch.nn.functional.one_hot(self.assignment, self.clusters).to(self.personal.dtype)  # [K, k]
        means = (members.T @ self.personal) / members.sum(0).clamp(min=1).unsqueeze(1)  # [k, P]
        return means[self.assignment]

    def _personal_anchor(self, silos: torch.Tensor) -> tuple[torch.Tensor | None, float]:
        return self._cluster_means()[silos], self.lam
