"""rdp.epsilons converts many RDP curves at once: each row must equal dp-accounting's compute_epsilon
of that curve exactly (the history's reference ε is labelled as dp-accounting's)."""

from __future__ import annotations

import numpy as np
import pytest
from dp_accounting import dp_event as de
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from dpledger.service.accounting import rdp


def curves() -> np.ndarray:
    rng = np.random.default_rng(7)
    rows = [np.zeros(len(rdp.ORDERS)), np.full(len(rdp.ORDERS), np.inf)]
    for _ in range(60):
        accountant = rdp_lib.RdpAccountant(list(rdp.ORDERS))
        q, sigma = float(10 ** rng.uniform(-4, -0.1)), float(10 ** rng.uniform(-0.3, 1.2))
        accountant.compose(de.PoissonSampledDpEvent(q, de.GaussianDpEvent(sigma)), int(rng.integers(1, 20_000)))
        rows.append(np.asarray(accountant.rdp))
    tiny = np.asarray(rows[5]) * 1e-12  # below δ's KL bound at large δ: ε = 0 there
    noisy = np.asarray(rows[6]).copy()
    noisy[3] = -1e-17  # a negative value from numerical noise at one order
    return np.vstack([*rows, tiny, noisy])


@pytest.mark.parametrize("delta", [1e-5, 1e-9, 0.3])
def test_each_row_is_dp_accountings_conversion_exactly(delta: float) -> None:
    matrix = curves()
    converted = rdp.epsilons(matrix, delta=delta)
    expected = [rdp_lib.compute_epsilon(rdp.ORDERS, row, delta)[0] for row in matrix]
    assert converted.tolist() == [float(e) for e in expected]
    assert converted[1] == np.inf and converted[0] == 0.0
