"""The README's two examples, run as they are (separate processes) against a real server; what each
is charged is checked against dp-accounting's curves read through the silo's published filter
(tests/gate_oracle.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dpledger.harness import running_server
from dpledger.wire.client import LedgerClient
from tests.conftest import ADMIN_KEY
from tests.gate_oracle import dpsgd_epsilon

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DIGITS, DELTA = 1797, 1e-5


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> str:  # type: ignore[no-untyped-def]
    with running_server(database_url=f"sqlite:///{tmp_path_factory.mktemp('examples')}/ledger.db", admin_key=ADMIN_KEY) as url:
        yield url


def run_example(name: str, server: str, *, epsilon: float) -> tuple[dict[str, float], LedgerClient, int]:
    with LedgerClient(server, ADMIN_KEY) as admin:
        silo = admin.create_silo(name=name, epsilon=epsilon, delta=DELTA, dataset_size=DIGITS)
    env = {**os.environ, "DPLEDGER_URL": server, "DPLEDGER_KEY": silo.api_key, "DPLEDGER_SILO": str(silo.id)}
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    numbers = dict(re.findall(r"(\w+) ([0-9.]+)", done.stdout.strip().splitlines()[-1]))
    return {k: float(v) for k, v in numbers.items()}, LedgerClient(server, silo.api_key), silo.id


def test_the_plain_pytorch_example_spends_what_it_planned(server: str) -> None:
    printed, client, silo_id = run_example("plain_pytorch.py", server, epsilon=3.0)
    with client:
        silo = client.silo(silo_id)
        sigmas = {e.mechanism["noise_multiplier"] for e in client.history(silo_id) if e.event == "reserve" and e.mechanism}
    spent = silo.epsilon_spent
    assert len(sigmas) == 1 and printed["epsilon"] == pytest.approx(spent, abs=1e-6)
    assert spent == pytest.approx(dpsgd_epsilon(silo, [(64 / DIGITS, sigmas.pop(), 50)], delta=DELTA), rel=1e-9)
    assert spent <= 3.0 and printed["accuracy"] > 0.5  # ten classes: chance is 0.1


def test_the_opacus_example_is_charged_its_poisson_steps(server: str) -> None:
    printed, client, silo_id = run_example("opacus_loop.py", server, epsilon=10.0)
    with client:
        silo = client.silo(silo_id)
    spent = silo.epsilon_spent
    # len(loader) = ceil(1797/64) = 29 steps per round, q = 1/29; the ledger's B = ceil(1797/29) = 62.
    assert printed["batch_size"] == 62 and printed["steps"] == 58
    assert spent == pytest.approx(dpsgd_epsilon(silo, [(62 / DIGITS, 1.0, 58)], delta=DELTA), rel=1e-9)
    assert printed["opacus_epsilon"] <= spent


@pytest.mark.parametrize("name", ["plain_pytorch.py", "opacus_loop.py"])
def test_the_readme_shows_each_example_as_it_runs_in_under_20_lines_of_user_code(name: str) -> None:
    source = (EXAMPLES / name).read_text()
    code = source[source.index('"""', 3) + 3 :].strip()
    assert f"```python\n{code}\n```" in (EXAMPLES.parent / "docs" / "guides" / "silo.md").read_text()
    user_lines = [line for line in code.splitlines() if line.strip() and not line.startswith(("import ", "from "))]
    assert len(user_lines) < 20
