"""A silo trains its own CNN on its own data, every round gated by the ledger (plain PyTorch).

Run with DPLEDGER_URL, DPLEDGER_KEY (the silo's key) and DPLEDGER_SILO (its id) set; the silo is
registered with dataset_size=1797 (scikit-learn's digits). Runs on CUDA when present.
"""

import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from dpledger.trainer.silo.dpsgd.engine import DPSGDEngine
from dpledger.trainer.silo.gate import RoundGate
from dpledger.wire.client import LedgerClient

digits, device = load_digits(), "cuda" if torch.cuda.is_available() else "cpu"
x, y = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1), torch.tensor(digits.target)
model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.Flatten(), nn.Linear(512, 10)).to(device)
engine = DPSGDEngine(model, torch.optim.SGD(model.parameters(), lr=0.5), data=(x, y), batch_size=64, max_grad_norm=1.0,
                     loss_fn=lambda out, target: F.cross_entropy(out, target, reduction="none"),
                     generator=torch.Generator(device).manual_seed(0))
with LedgerClient(os.environ["DPLEDGER_URL"], os.environ["DPLEDGER_KEY"]) as ledger:
    gate = RoundGate(ledger, silo_id=int(os.environ["DPLEDGER_SILO"]), sampler=engine.sampler)
    sigma = gate.calibrate(rounds=5, steps_per_round=10).noise_multiplier  # σ that what is left covers
    for _ in range(5):
        with gate.round(steps=10, noise_multiplier=sigma) as permit:
            for _ in range(permit.steps):
                engine.step(permit)
    accuracy = (model(x.to(device)).argmax(1).cpu() == y).float().mean().item()
    print(f"sigma {sigma:.4f} epsilon {ledger.silo(gate.silo_id).epsilon_spent:.6f} accuracy {accuracy:.3f}")
