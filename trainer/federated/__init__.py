"""Federated algorithms batched over silos, each declaring its true privacy cost per round.

All K silos share one architecture; their parameters are stacked into [K, P] tensors and trained in
one `vmap`-ed computation (`dpledger.trainer.silo.dpsgd.batched`). Every algorithm implements `FederatedAlgorithm`:
`round_mechanisms(r)` (what each silo's round r will query, in the ledger's wire format),
`run_round(r, approved)` (only approved silos touch their data) and `evaluate()`.

Each algorithm class names itself (`name`), and says what a round charges each silo (`cost`) and
which model each silo deploys (`deploys`); `registry` lists them, for the job file, the worker's
command line and the README's table (`dpledger train --algorithms` prints it).

The `DPSGDConfig` defaults (small tanh MLP, lr 0.5, C 1, σ 1, B 16, E 10) take MR-MTL on 8x8
digits (features scaled to [0, 1]) to well above chance within 20 rounds, in seconds on CPU.
"""

from dpledger.trainer.federated.base import AlgorithmArgs, FederatedAlgorithm
from dpledger.trainer.federated.config import DPSGDConfig, RoundResult, Task, Weighting
from dpledger.trainer.federated.ditto import Ditto
from dpledger.trainer.federated.fedavg import FedAvg
from dpledger.trainer.federated.fedhdp import AdaptiveClip, FedHDP
from dpledger.trainer.federated.finetune import Finetuning
from dpledger.trainer.federated.ifca import IFCA, ClusteredMRMTL, clustering_rounds
from dpledger.trainer.federated.local import LocalTraining
from dpledger.trainer.federated.models import (
    Architecture,
    FlatModel,
    ModelFactory,
    build_model,
)
from dpledger.trainer.federated.mrmtl import MRMTL
from dpledger.trainer.federated.pfa import PFA, GroupAggregated
from dpledger.trainer.federated.pmtl import PMTL
from dpledger.trainer.federated.ppsgd import PPSGD
from dpledger.trainer.federated.selection import ClusterSelection

__all__ = [
    "IFCA",
    "MRMTL",
    "PFA",
    "PMTL",
    "PPSGD",
    "AdaptiveClip",
    "AlgorithmArgs",
    "Architecture",
    "ClusterSelection",
    "ClusteredMRMTL",
    "DPSGDConfig",
    "Ditto",
    "FedAvg",
    "FedHDP",
    "FederatedAlgorithm",
    "Finetuning",
    "FlatModel",
    "GroupAggregated",
    "LocalTraining",
    "ModelFactory",
    "RoundResult",
    "Task",
    "Weighting",
    "build_model",
    "clustering_rounds",
]
