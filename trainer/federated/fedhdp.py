"""FedHDP in the cross-silo worker: two-step aggregation by privacy group (FedHDP §4, Alg. 2),
with groups found from update norms after Liu et al. 2023's warm-start round (`GroupAggregated`).

What is kept of Alg. 2 and why:
- Step 1 averages each group's updates, step 2 weighs the group means by w_g ∝ r_g·N_g
  (`fedhdp_aggregate`; FedHDP §4, two groups: w_1 = N_1/(N_1 + rN_2)).
- r is either a fixed hyperparameter (FedHDP §5 tunes it by grid search) or estimated each round
  from the updates alone (`budget_blind_ratio`, Lemma 1's inverse-variance weighting), so the
  coordinator needs no budget. The estimate is clamped to [0, 1], the range FedHDP §4 asks of r
  (a noisier group never outweighs the reference one).
- Updates may be clipped at S (Alg. 2 Clip), and S adapted by the noisy quantile query of Alg. 2's
  last line (Andrew et al. 2021). Each silo's indicator b = 1[‖Δθ‖ ≤ S] is read by that query, so
  the round's mechanism becomes composed(dpsgd, gaussian(σ_b)) (docs/ARCHITECTURE.md lists the quantile query
  as a charged query). Strictly, b is computed from the already-noisy DP-SGD output and is
  post-processing; charging it is conservative and keeps the ledger's view equal to Alg. 2's.
- Not kept: Alg. 2's server-side Gaussian noise per group (client-level DP against the server);
  here each silo's sample-level DP comes from its own DP-SGD (docs/ARCHITECTURE.md, "The privacy model"), so
  the aggregate is post-processing. Nor Alg. 2's personalized θ_j (Ditto-like): every silo deploys
  the global model, the quantity FedHDP reports as Acc_g.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from dpledger.trainer.aggregation import (
    budget_blind_ratio,
    clip_updates,
    fedhdp_aggregate,
    noisy_quantile_clip_update,
)
from dpledger.trainer.federated.config import DPSGDConfig, derive_seed, make_generator
from dpledger.trainer.federated.engine import SiloEngine
from dpledger.trainer.federated.halves import Halves, ServerStart
from dpledger.trainer.federated.pfa import WARM_START_ROUND, GroupAggregated, GroupServer, UpdateSilo
from dpledger.trainer.federated.plan import QUANTILE_QUERIES, PlannedQuery
from dpledger.wire.mechanisms import Gaussian

# A random stream of its own for the quantile query's noise, distinct from STREAM_INIT/SAMPLER/
# NOISE/CLIENTS (0–3 in trainer.federated.config), so enabling the query never shifts DP-SGD's draws.
STREAM_QUANTILE = 4

RatioChoice = float | Literal["budget_blind"]


@dataclass(frozen=True, kw_only=True)
class AdaptiveClip:
    """Alg. 2's clip adaptation: S⁰, the target quantile κ, the factor η_b, and σ_b, the noise
    multiplier of the count of unclipped updates (sensitivity 1 per silo)."""

    initial_clip: float
    noise_multiplier: float
    target_quantile: float = 0.5
    learning_rate: float = 0.2

    def __post_init__(self) -> None:
        for name in ("initial_clip", "noise_multiplier", "learning_rate"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0. Found {value}.")
        if not 0.0 < self.target_quantile < 1.0:
            raise ValueError(f"target_quantile must be in (0, 1). Found {self.target_quantile}.")

    def mechanism(self) -> Gaussian:
        return Gaussian(noise_multiplier=float(self.noise_multiplier))


def blind_group_ratios(updates: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """[G]: r_g of each compacted group (0..G−1) estimated from the updates alone, clamped to [0, 1]
    (FedHDP §4 asks r ≤ 1: a noisier group never outweighs the reference one)."""
    n_groups = int(groups.max()) + 1
    counts = torch.bincount(groups, minlength=n_groups)
    if int(counts.max()) < 2:
        # No group has two silos, so no within-group variance can be estimated (see
        # `budget_blind_ratio`): fall back to r = 1, HDP-FedAvg (FedHDP §5).
        return torch.ones(n_groups, dtype=torch.float64)
    return budget_blind_ratio(updates, groups, n_groups=n_groups).clamp(0.0, 1.0)


class QuantileSilo(UpdateSilo):
    """PFA's silo half, declaring the quantile query that reads its clipping indicator in every
    aggregation round when the clip adapts (Alg. 2, last line), composed with its DP-SGD steps."""

    def __init__(self, config: DPSGDConfig, *, adaptive_clip: AdaptiveClip | None) -> None:
        super().__init__(config)
        self.adaptive_clip = adaptive_clip

    def extra_queries(self, round_index: int, engine: SiloEngine, row: int) -> tuple[PlannedQuery, ...]:
        if self.adaptive_clip is None or round_index == WARM_START_ROUND:
            return ()
        return (PlannedQuery(QUANTILE_QUERIES, 1, self.adaptive_clip.mechanism()),)


class FedHDPServer(GroupServer):
    """Σ_g w_g ū_g with w_g ∝ r_g N_g over the (clipped) updates; S adapted by the noisy quantile query."""

    def __init__(self, start: ServerStart, *, ratio: RatioChoice, update_clip: float | None,
                 adaptive_clip: AdaptiveClip | None, seed: int) -> None:
        super().__init__(start)
        self.ratio = ratio
        self.adaptive_clip = adaptive_clip
        self.clip_norm: float | None = adaptive_clip.initial_clip if adaptive_clip is not None else update_clip
        self.quantile_generator = make_generator(derive_seed(seed, STREAM_QUANTILE), torch.device("cpu"))
        self.record = start.record
        # What each aggregation round used, for reports: r_g per (compacted) group, and S.
        self.ratio_history: list[list[float]] = []
        self.clip_history: list[float] = []

    def _ratios(self, updates: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        n_groups = int(groups.max()) + 1
        if self.ratio != "budget_blind":
            return torch.tensor([1.0] + [float(self.ratio)] * (n_groups - 1), dtype=torch.float64)
        return blind_group_ratios(updates, groups)

    def aggregate_updates(self, round_index: int, members: torch.Tensor, updates: torch.Tensor,
                          groups: torch.Tensor) -> torch.Tensor:
        norms = torch.linalg.vector_norm(updates, dim=1)
        clipped = updates if self.clip_norm is None else clip_updates(updates, clip_norm=self.clip_norm)
        ratios = self._ratios(clipped, groups)
        self.ratio_history.append(ratios.tolist())
        aggregate = fedhdp_aggregate(clipped, groups, ratios=ratios)
        if self.adaptive_clip is not None:
            assert self.clip_norm is not None
            self.clip_history.append(self.clip_norm)
            step = noisy_quantile_clip_update(
                norms.detach().cpu().to(torch.float64),
                clip_norm=self.clip_norm,
                target_quantile=self.adaptive_clip.target_quantile,
                learning_rate=self.adaptive_clip.learning_rate,
                noise_multiplier=self.adaptive_clip.noise_multiplier,
                generator=self.quantile_generator,
            )
            # The query read every trained silo's indicator; the simulator's round check compares
            # the mechanism it reports with the one each silo was charged for.
            self.record(QUANTILE_QUERIES, members, step.mechanism)
            self.clip_norm = step.clip_norm
        return aggregate


class FedHDP(GroupAggregated):
    """Global model from local DP-SGD, aggregated as Σ_g w_g ū_g with w_g ∝ r_g N_g (FedHDP Alg. 2).

    `ratio`: r of every group but the least noisy one (r_0 = 1), or "budget_blind" to estimate r_g
    per round from the updates. `update_clip`: a fixed S (post-processing, free), or
    `adaptive_clip` to adapt S by the charged quantile query; at most one of the two.
    """

    name = "fedhdp"
    cost = "dpsgd(B_k/n_k, σ, E) (+ gaussian quantile query if adaptive)"
    deploys = "global model"

    @classmethod
    def halves(cls, config: DPSGDConfig, *, ratio: RatioChoice, update_clip: float | None = None,
               adaptive_clip: AdaptiveClip | None = None) -> Halves:
        if ratio != "budget_blind" and (
            isinstance(ratio, bool) or not isinstance(ratio, int | float) or not (math.isfinite(ratio) and ratio >= 0)
        ):
            raise ValueError(f"ratio must be a finite number >= 0 or 'budget_blind'. Found {ratio!r}.")
        if update_clip is not None and adaptive_clip is not None:
            raise ValueError("Give update_clip (a fixed S) or adaptive_clip (S adapted by a quantile query), not both.")
        if update_clip is not None and not (math.isfinite(update_clip) and update_clip > 0):
            raise ValueError(f"update_clip must be finite and > 0. Found {update_clip}.")
        chosen: RatioChoice = ratio if ratio == "budget_blind" else float(ratio)
        return Halves(QuantileSilo(config, adaptive_clip=adaptive_clip),
                      lambda start: FedHDPServer(start, ratio=chosen, update_clip=update_clip,
                                                 adaptive_clip=adaptive_clip, seed=config.seed))
