"""One conformance suite for the one round protocol (trainer/silo/rounds.py), run against each silo-side
runner over a real ledger server on a real SQLite file: the library's round gate (RoundGate), the
in-process simulator's loop (run_gated), and the Flower ClientApp's mod (ledger_gate).

Every runner must: charge a round under the one key `round_key(job, round, silo)`; train only on a
reservation its own attempt made (a redelivery whose answer is lost on the way finds another
attempt's id and never trains, the case where a round used to train twice on one charge); commit
whenever the body may have touched the data; release only when it provably did not."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from dpledger.harness import running_server
from dpledger.trainer.data.digits import make_rotated_masked_digits
from dpledger.trainer.federated import MRMTL, DPSGDConfig
from dpledger.trainer.loop import GatedSilo, run_gated
from dpledger.trainer.silo.dpsgd.sampler import PoissonSampler
from dpledger.trainer.silo.gate import RoundGate
from dpledger.trainer.silo.rounds import round_key
from dpledger.wire.client import LedgerClient
from dpledger.wire.enums import ChargeStatus
from dpledger.wire.errors import NotOwned
from tests.conftest import ADMIN_KEY

DELTA, SIGMA, STEPS, BATCH = 1e-5, 1.0, 2, 12
NAMES = count()


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    db = tmp_path_factory.mktemp("protocol") / "ledger.db"
    with running_server(database_url=f"sqlite:///{db}", admin_key=ADMIN_KEY) as url:
        yield url, db


@dataclass
class Charge:
    key: str
    status: ChargeStatus
    attempt_id: str | None


def charges_of(db: Path, silo_id: int) -> list[Charge]:
    """Read from the ledger's own file: the key a runner used is not part of any answer."""
    with sqlite3.connect(db) as connection:
        rows = connection.execute(
            "SELECT idempotency_key, status, attempt_id FROM charges WHERE silo_id = ? ORDER BY id", (silo_id,)
        ).fetchall()
    return [Charge(key, ChargeStatus(status), attempt) for key, status, attempt in rows]


class Runner:
    """One silo-side runner: `train(round, fail_after_touch=False)` runs one round and says whether
    its trainer ran; `job` is the job name its charges carry."""

    job: str

    def train(self, round: int, *, fail_after_touch: bool = False) -> bool:
        raise NotImplementedError


class GateRunner(Runner):
    def __init__(self, client: LedgerClient, silo_id: int, size: int) -> None:
        self.job = f"gate-{next(NAMES)}"
        sampler = PoissonSampler(dataset_size=size, batch_size=BATCH, generator=torch.Generator().manual_seed(0))
        self.gate = RoundGate(client, silo_id=silo_id, sampler=sampler, job_id=self.job)

    def train(self, round: int, *, fail_after_touch: bool = False) -> bool:
        try:
            with self.gate.round(steps=STEPS, noise_multiplier=SIGMA, round=round) as permit:
                permit.take(noise_multiplier=SIGMA)
                if fail_after_touch:
                    raise RuntimeError("the body failed after its first step")
                return True
        except NotOwned:
            return False


class LoopRunner(Runner):
    """Each `train` is a run of one round under the runner's job id (a fresh simulator, as a re-run is)."""

    def __init__(self, client: LedgerClient, silo_id: int, algorithm: Callable[[], MRMTL] | None = None) -> None:
        self.job = f"loop-{next(NAMES)}"
        self.silo, self.make = GatedSilo(silo_id, client), algorithm or loop_algorithm

    def train(self, round: int, *, fail_after_touch: bool = False) -> bool:
        assert round == 0 and not fail_after_touch  # a run of one round; the simulator's body cannot fail midway
        algorithm, approvals = self.make(), []
        run_round = algorithm.run_round

        def counting(round_index: int, approved: torch.Tensor) -> Any:
            approvals.append(bool(approved[0]))
            return run_round(round_index, approved)

        algorithm.run_round = counting  # type: ignore[method-assign]  # records whether the silo was let train
        run_gated(algorithm, [self.silo], rounds=1, job_id=self.job)
        return any(approvals)


def loop_algorithm() -> MRMTL:
    data = make_rotated_masked_digits(n_silos=1, seed=3)
    config = DPSGDConfig(batch_size=BATCH, local_steps=STEPS, noise_multiplier=SIGMA, seed=3)
    return MRMTL(lam=0.5, **data.tensors(), num_classes=10, config=config)


class FlowerRunner(Runner):
    def __init__(self, url: str, key: str, silo_id: int, folder: Path) -> None:
        from flwr.app import Context, RecordDict

        from dpledger.flower.gate import ledger_job
        from tests.flower.federation import write_silo_files

        (data,) = write_silo_files(folder, silos=1, train=60, test=10)
        with LedgerClient(url, ADMIN_KEY) as admin:
            self.job_id = admin.create_job(name=folder.name, silo_ids=[silo_id])
        self.job = ledger_job(self.job_id)
        key_file = folder / "silo.key"
        key_file.write_text(key)
        node_config = {"ledger-url": url, "silo-id": silo_id, "key-file": str(key_file), "data-path": str(data),
                       "noise-multiplier": SIGMA}
        self.context = Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})

    def train(self, round: int, *, fail_after_touch: bool = False) -> bool:
        from flwr.app import Message

        from dpledger.flower.client_app import train
        from dpledger.flower.gate import ledger_gate
        from tests.flower.test_gate import train_message

        calls = []

        def trainer(message: Message, context: Any) -> Message:
            calls.append(message)
            if fail_after_touch:
                raise RuntimeError("the ClientApp failed while training")
            return train(message, context)

        ledger_gate(train_message(self.job_id, round), self.context, trainer)
        return bool(calls)


RUNNERS = ("gate", "loop", "flower")


@pytest.fixture(params=RUNNERS)
def runner(request: pytest.FixtureRequest, ledger: tuple[str, Path], tmp_path: Path) -> Iterator[tuple[Runner, int]]:
    url, _ = ledger
    if request.param == "flower":
        pytest.importorskip("flwr", reason="flwr is not installed (the `flower` extra)")
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 7, 1  # as a flwr-clientapp sets them
    size = loop_algorithm().train.sizes[0] if request.param == "loop" else 60
    with LedgerClient(url, ADMIN_KEY) as admin:
        created = admin.create_silo(name=f"protocol-{next(NAMES)}", epsilon=50.0, delta=DELTA, dataset_size=size)
    client = LedgerClient(url, created.api_key)
    made: Runner
    if request.param == "gate":
        made = GateRunner(client, created.id, size)
    elif request.param == "loop":
        made = LoopRunner(client, created.id)
    else:
        made = FlowerRunner(url, created.api_key, created.id, tmp_path)
    yield made, created.id
    client.close()
    if request.param == "flower":
        TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None


def lost_answer_redelivery(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every reserve becomes: an earlier delivery's reserve that lands and whose worker dies (never
    settles), then this delivery's reserve, whose first answer a proxy drops (the client retries
    and is answered the replay). Returns the attempt ids of the earlier deliveries."""
    original: Callable[..., Any] = LedgerClient.reserve
    earlier: list[str] = []

    def redelivered(self: LedgerClient, silo_id: int, **kwargs: Any) -> Any:
        first = original(self, silo_id, **kwargs)
        earlier.append(first.own_attempt_id)
        real = self._http.request
        lost = [False]

        def drops_first_answer(method: str, url: str, **rest: Any) -> httpx.Response:
            response = real(method, url, **rest)
            if not lost[0] and method == "POST" and str(url).endswith("/charges"):
                lost[0] = True
                raise httpx.ReadError("the proxy dropped the answer")
            return response

        self._http.request = drops_first_answer  # type: ignore[method-assign]  # this call only
        try:
            return original(self, silo_id, **kwargs)
        finally:
            del self._http.request
            assert lost[0]

    monkeypatch.setattr(LedgerClient, "reserve", redelivered)
    return earlier


def test_a_round_trains_once_and_is_committed_under_the_one_key(runner: tuple[Runner, int], ledger: tuple[str, Path]) -> None:
    made, silo_id = runner
    assert made.train(0)
    (charge,) = charges_of(ledger[1], silo_id)
    assert charge.key == round_key(made.job, 0, silo_id) and charge.status is ChargeStatus.committed
    assert charge.attempt_id is not None and len(charge.attempt_id) >= 16


def test_the_same_round_again_never_trains(runner: tuple[Runner, int], ledger: tuple[str, Path]) -> None:
    made, silo_id = runner
    assert made.train(0)
    assert not made.train(0)
    assert [c.status for c in charges_of(ledger[1], silo_id)] == [ChargeStatus.committed]


def test_a_redelivery_whose_answer_is_lost_never_trains_on_the_earlier_reservation(
    runner: tuple[Runner, int], ledger: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    made, silo_id = runner
    earlier = lost_answer_redelivery(monkeypatch)
    assert not made.train(0)
    (charge,) = charges_of(ledger[1], silo_id)
    # Spent (its worker may have read the data) and held by the earlier delivery, for an operator to settle.
    assert charge.status is ChargeStatus.reserved and charge.attempt_id == earlier[0]
    assert charge.key == round_key(made.job, 0, silo_id)


@pytest.mark.parametrize("runner", ["gate", "flower"], indirect=True)
def test_a_body_that_fails_after_touching_the_data_is_committed(runner: tuple[Runner, int], ledger: tuple[str, Path]) -> None:
    made, silo_id = runner
    try:
        made.train(0, fail_after_touch=True)
    except RuntimeError:
        pass  # the gate re-raises the body's error; the mod answers "failed"
    assert [c.status for c in charges_of(ledger[1], silo_id)] == [ChargeStatus.committed]


def test_a_round_that_provably_never_touched_the_data_is_released(ledger: tuple[str, Path]) -> None:
    """The gate: a body that raises before its first step; the loop: an approved silo that took no step."""
    url, db = ledger
    with LedgerClient(url, ADMIN_KEY) as admin:
        created = admin.create_silo(name=f"untouched-{next(NAMES)}", epsilon=50.0, delta=DELTA, dataset_size=60)
    with LedgerClient(url, created.api_key) as client:
        gate = GateRunner(client, created.id, 60).gate
        with pytest.raises(ValueError, match="before any step"):
            with gate.round(steps=STEPS, noise_multiplier=SIGMA):
                raise ValueError("before any step")
        assert [c.status for c in charges_of(db, created.id)] == [ChargeStatus.released]
        assert client.silo(created.id).epsilon_spent == 0.0

    def takes_no_step() -> MRMTL:
        algorithm = loop_algorithm()
        run_round = algorithm.run_round
        # Approved, but the algorithm draws no batch for it this round (its result says 0 steps).
        algorithm.run_round = lambda r, approved: run_round(r, torch.zeros_like(approved))  # type: ignore[method-assign]
        return algorithm

    with LedgerClient(url, ADMIN_KEY) as admin:
        created = admin.create_silo(name=f"untouched-{next(NAMES)}", epsilon=50.0, delta=DELTA,
                                    dataset_size=loop_algorithm().train.sizes[0])
    with LedgerClient(url, created.api_key) as client:
        LoopRunner(client, created.id, takes_no_step).train(0)
        assert [c.status for c in charges_of(db, created.id)] == [ChargeStatus.released]
