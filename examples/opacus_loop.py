"""An existing Opacus PrivacyEngine loop, gated by the ledger: the accountant's name, one `with` per round.

Run with DPLEDGER_URL, DPLEDGER_KEY (the silo's key) and DPLEDGER_SILO (its id) set; the silo is
registered with dataset_size=1797 (scikit-learn's digits).
"""

import os

import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpledger.trainer.silo.opacus_gate import ACCOUNTANT, OpacusGate
from dpledger.wire.client import LedgerClient

digits = load_digits()
data = TensorDataset(torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1), torch.tensor(digits.target))
model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.Flatten(), nn.Linear(512, 10))
engine = PrivacyEngine(accountant=ACCOUNTANT)  # change 1 of 2: the ledger's accountant
model, optimizer, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                               data_loader=DataLoader(data, batch_size=64),
                                               noise_multiplier=1.0, max_grad_norm=1.0)
with LedgerClient(os.environ["DPLEDGER_URL"], os.environ["DPLEDGER_KEY"]) as ledger:
    gate = OpacusGate(ledger, silo_id=int(os.environ["DPLEDGER_SILO"]), privacy_engine=engine, module=model,
                      optimizer=optimizer, data_loader=loader)
    for _ in range(2):
        with gate.round(steps=len(loader)):  # change 2 of 2: one `with` block per round
            for x, y in loader:
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
    print(f"epsilon {ledger.silo(gate.silo_id).epsilon_spent:.6f} opacus_epsilon {engine.get_epsilon(1e-5):.6f} "
          f"batch_size {gate.sampler.batch_size} steps {sum(r.steps_taken for r in gate.results)}")
