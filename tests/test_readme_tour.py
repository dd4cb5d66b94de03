"""The README's "Run your own ledger" tour (between its `tour` snippet markers), run as a new user
would: verbatim, with `bash -eu`, in an empty folder whose `.venv` is this environment's, real
processes on 127.0.0.1 (its port from PORT, the block's own default 8000, set here to a free one).

Asserted, each against a computation of its own: the block exits 0; both silos are registered with
the 674 training records each that the digits split in two gives them; the plan says how many rounds
clinic-b's budget buys, and that is the number of rounds dp-accounting, read through the silo's
published filter, says ε = 2 buys at the job's DP-SGD; `train` stops clinic-b at the next round and
the ledger's ε spent for each silo is that oracle's ε of the rounds it trained; the job's output
folder holds its models, metrics and summary; `verify` recomputes every hash. The ledger the block
leaves running is killed at the end, with everything else the block started.
"""

from __future__ import annotations

import os
import re
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from dpledger.harness import free_port
from dpledger.trainer.data.digits import make_rotated_masked_digits
from dpledger.trainer.federated import DPSGDConfig
from tests import gate_oracle
from tests.block_processes import kill_all, run_block, started_in

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BEGIN, END = "<!-- --8<-- [start:tour] -->", "<!-- --8<-- [end:tour] -->"
FENCE = "```\n"
BLOCK_TIMEOUT = 600.0  # seconds; about 90 s on two quiet cores, several times that beside other tests
DELTA = 1e-5


def tour_block() -> str:
    readme = (ROOT / "README.md").read_text()
    assert readme.count(BEGIN) == 1 and readme.count(END) == 1, "the README's tour markers"
    tour = readme.split(BEGIN, 1)[1].split(END, 1)[0]
    marker = "<!-- runs-in: tests/test_readme_tour.py -->\n" + FENCE
    assert tour.count(marker) == 1, "the tour's one block, marked to run here"
    return tour.split(marker, 1)[1].split(FENCE, 1)[0]


def job_file(block: str) -> dict[str, object]:
    """The job.toml the block writes (its here-document), with the URL it expands left as written."""
    text = block.split("cat > job.toml <<TOML\n", 1)[1].split("\nTOML\n", 1)[0]
    return tomllib.loads(text)


def setting(block: str, pattern: str) -> str:
    found = re.findall(pattern, block)
    assert len(found) == 1, f"{pattern!r} in the tour: {found}"
    return str(found[0])


def rounds_bought(detail: dict[str, object], *, budget: float, q: float, sigma: float, steps: int, most: int) -> int:
    """The most rounds (up to `most`) whose ε, read through the silo's published filter, fits `budget`."""
    bought = 0
    while bought < most and gate_oracle.dpsgd_epsilon(detail, [(q, sigma, steps * (bought + 1))], delta=DELTA) <= budget:
        bought += 1
    return bought


def test_the_readme_tour_runs_as_pasted_into_an_empty_folder(tmp_path: Path) -> None:
    block = tour_block()
    job = job_file(block)
    rounds, sigma = int(job["rounds"]), float(job["dpsgd"]["noise_multiplier"])  # type: ignore[index]
    steps = DPSGDConfig().local_steps  # the job file leaves DP-SGD's steps at the default
    batch = int(setting(block, r"clinic-b .*--horizon-batch (\d+)"))
    size = int(setting(block, r"clinic-b .*--dataset-size (\d+)"))
    budgets = {"hospital-a": float(setting(block, r"hospital-a --epsilon ([\d.]+)")),
               "clinic-b": float(setting(block, r"clinic-b --epsilon ([\d.]+)"))}
    digits = make_rotated_masked_digits(n_silos=2, seed=0)  # `dpledger train`'s digits source, split in two
    assert [s.n_train for s in digits.silos] == [size, size]

    folder = tmp_path / "root"
    folder.mkdir()
    (folder / ".venv").symlink_to(BIN.parent)  # the first command made .venv at the repository's root
    script = tmp_path / "tour.sh"
    script.write_text(block)
    port = free_port()
    env = {**os.environ, "PORT": str(port), "PYTHONUNBUFFERED": "1"}
    for inherited in ("DPLEDGER_KEY", "DPLEDGER_URL", "DPLEDGER_ADMIN_KEY", "DPLEDGER_ENV", "DPLEDGER_SIGNING_KEY_FILE",
                      "DATABASE_URL", "VIRTUAL_ENV", "SILO1_KEY", "SILO2_KEY"):
        env.pop(inherited, None)
    log = tmp_path / "tour.log"
    started = time.monotonic()
    shell = run_block(script, folder=folder, env=env, log=log, timeout=BLOCK_TIMEOUT)
    try:
        text = log.read_text()
        assert shell.returncode == 0, text[-4000:]
        print(f"the README's tour ran in {time.monotonic() - started:.0f} s")
        here = folder / "my-ledger"
        assert (here / "dpledger.db").is_file()

        admin_key = setting(text, r"admin key: (\S+)")
        url = f"http://127.0.0.1:{port}"
        headers = {"Authorization": f"Bearer {admin_key}"}
        listed = {s["name"]: s for s in httpx.get(f"{url}/v1/silos", headers=headers, timeout=30).json()}
        assert sorted(listed) == sorted(budgets)
        trained = {}
        for name, budget in budgets.items():
            detail = httpx.get(f"{url}/v1/silos/{listed[name]['id']}", headers=headers, timeout=30).json()
            assert (detail["epsilon"], detail["dataset_size"]) == (budget, size)
            bought = rounds_bought(detail, budget=budget, q=batch / size, sigma=sigma, steps=steps, most=rounds)
            trained[name] = bought
            expected = gate_oracle.dpsgd_epsilon(detail, [(batch / size, sigma, steps * bought)], delta=DELTA)
            assert detail["epsilon_spent"] == pytest.approx(expected, rel=1e-9), name
            assert detail["epsilon_spent"] <= budget
        assert trained["clinic-b"] < rounds, "the tour's story: the ledger stops clinic-b before the last round"

        # The plan's row for clinic-b ends with the rounds its budget buys (then the σ for all rounds); the
        # run's table says how many rounds each silo trained, and the run names the round it refused.
        bought_b = trained["clinic-b"]
        assert re.search(rf"^\d+\s+clinic-b\s.*\s{bought_b}\s+[\d.]+$", text, re.MULTILINE), text[-4000:]
        for name, approved in trained.items():
            assert re.search(rf"^\d+\s+{name}\s+[\d.]+\s+[\d.]+ \([\d.]+\)\s+{approved}\s+{int(approved < rounds)}\s",
                             text, re.MULTILINE), (name, text[-4000:])
        assert f"(clinic-b): refused at round {bought_b + 1}:" in text
        assert trained["hospital-a"] == rounds

        out = here / f"dpledger-job-{job['job_id']}"
        assert {p.name for p in out.iterdir()} >= {"models.pt", "metrics.jsonl", "summary.json"}
        assert "every hash recomputes" in text
    finally:
        if shell.poll() is None:
            shell.kill()
            shell.wait()
        deadline = time.monotonic() + 10
        while started_in(folder, shell.pid) and time.monotonic() < deadline:
            kill_all(started_in(folder, shell.pid))
            time.sleep(0.2)
        assert started_in(folder, shell.pid) == []
