"""Issue 13 on the worker's side: `dpledger train` run twice spends twice, a resumed run skips the
rounds its ledger holds committed, a replayed charge runs no step, and a silo whose registered
dataset_size exceeds its training records stops before round 0. Against a real ledger over HTTP."""

from __future__ import annotations

import pytest

from dpledger.harness import running_server
from dpledger.trainer.client import LedgerClient
from dpledger.trainer.data.digits import make_rotated_masked_digits
from dpledger.trainer.federated import MRMTL, DPSGDConfig
from dpledger.trainer.loop import GatedSilo, RegisteredSizeError, run_gated
from dpledger.worker_cli import main
from tests.conftest import ADMIN_KEY

CONFIG = DPSGDConfig(batch_size=16, local_steps=1, noise_multiplier=1.5, seed=3)


@pytest.fixture(scope="module")
def ledger(tmp_path_factory) -> str:  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path_factory.mktemp('once')}/ledger.db"
    with running_server(database_url=url, admin_key=ADMIN_KEY) as base:
        yield base


def train_sizes() -> list[int]:
    return [s.n_train for s in make_rotated_masked_digits(n_silos=2, seed=0, mask_probability=0.1).silos]


def make_silos(ledger: str, prefix: str, sizes: list[int]) -> list[dict]:
    with LedgerClient(ledger, ADMIN_KEY) as admin:
        return [admin.create_silo(name=f"{prefix}-{k}", epsilon=50.0, delta=1e-5, dataset_size=n) for k, n in enumerate(sizes)]


def job_file(tmp_path, ledger: str, created: list[dict], *, rounds: int, extra: str = "") -> str:  # type: ignore[no-untyped-def]
    path = tmp_path / f"job-{rounds}.toml"
    path.write_text(
        f'url = "{ledger}"\nalgorithm = "local"\nrounds = {rounds}\n{extra}'
        "[data]\nsilos = 2\n[dpsgd]\nlocal_steps = 1\n"
        + "".join(f'[[silos]]\nid = {c["id"]}\nkey = "{c["api_key"]}"\n' for c in created)
    )
    return str(path)


def ledger_view(ledger: str, silo: dict) -> tuple[float, list[tuple[str, int, str]]]:
    with LedgerClient(ledger, silo["api_key"]) as client:
        spent = client.silo(silo["id"])["epsilon_spent"]
        charges = [(c["job_id"], c["round"], c["status"]) for c in client.charges(silo["id"])]
    return spent, charges


def test_train_run_twice_in_a_row_spends_twice(ledger: str, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    created = make_silos(ledger, "twice", train_sizes())
    config = job_file(tmp_path, ledger, created, rounds=2, extra='job_id = "same-name"\n')
    assert main(["train", config]) == 0
    once, _ = ledger_view(ledger, created[0])
    assert main(["train", config]) == 0
    twice, both = ledger_view(ledger, created[0])

    assert [status for *_, status in both] == ["committed"] * 4  # 2 rounds × 2 runs, each run its own charges
    assert len({job for job, *_ in both}) == 2 and all(job.startswith("same-name-") for job, *_ in both)
    assert twice > once > 0
    out = capsys.readouterr().out
    assert out.count("job id: same-name-") == 2
    assert f"silo {created[0]['id']}: {train_sizes()[0]} training records" in out


def test_a_resumed_run_skips_the_rounds_already_committed(ledger: str, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    created = make_silos(ledger, "resume", train_sizes())
    assert main(["train", job_file(tmp_path, ledger, created, rounds=2)]) == 0
    (job_id,) = {job for job, *_ in ledger_view(ledger, created[0])[1]}
    capsys.readouterr()

    resumed = job_file(tmp_path, ledger, created, rounds=3, extra=f'job_id = "{job_id}"\nresume = true\n')
    assert main(["train", resumed]) == 0

    _, charges = ledger_view(ledger, created[0])
    assert charges == [(job_id, 0, "committed"), (job_id, 1, "committed"), (job_id, 2, "committed")]  # only round 2 ran
    assert "rounds approved 1," in capsys.readouterr().out


def test_a_replayed_charge_runs_no_step(ledger: str) -> None:
    data = make_rotated_masked_digits(n_silos=2, seed=0)
    created = make_silos(ledger, "replay", [s.n_train for s in data.silos])
    silos = [GatedSilo(c["id"], LedgerClient(ledger, c["api_key"])) for c in created]
    first = run_gated(MRMTL(lam=0.5, **data.tensors(), num_classes=10, config=CONFIG), silos, rounds=2, job_id="fixed")
    spent = ledger_view(ledger, created[0])[0]
    # The same job id again (what a default job id did): every reservation is a replay of a
    # committed charge, so no silo trains and the ledger does not move.
    second = run_gated(MRMTL(lam=0.5, **data.tensors(), num_classes=10, config=CONFIG), silos, rounds=2, job_id="fixed")
    assert first.approved_rounds() == [2, 2] and second.approved_rounds() == [0, 0]
    assert ledger_view(ledger, created[0])[0] == spent


def test_a_registered_size_larger_than_the_training_split_stops_before_round_0(ledger: str, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    sizes = train_sizes()
    created = make_silos(ledger, "size", [sizes[0], sizes[1] + 1])
    assert main(["train", job_file(tmp_path, ledger, created, rounds=1)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f"registered dataset_size {sizes[1] + 1}" in line and f"the {sizes[1]} training records" in line
    for silo in created:
        assert ledger_view(ledger, silo)[1] == []  # nothing was reserved
    with pytest.raises(RegisteredSizeError):
        data = make_rotated_masked_digits(n_silos=2, seed=0, mask_probability=0.1)
        silos = [GatedSilo(c["id"], LedgerClient(ledger, c["api_key"])) for c in created]
        run_gated(MRMTL(lam=0.5, **data.tensors(), num_classes=10, config=CONFIG), silos, rounds=1, job_id="x")
