"""The silo's mod against a real ledger server: a replayed train message never trains twice, a
denial never reaches the trainer and says only "declined", settings come from the node config."""

from __future__ import annotations

import pytest

flwr = pytest.importorskip("flwr", reason="flwr is not installed (the `flower` extra)")

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from dp_accounting import dp_event as de  # noqa: E402
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict  # noqa: E402

from dpledger.flower import family, records  # noqa: E402
from dpledger.flower.checkpoint import SiloStates  # noqa: E402
from dpledger.flower.client_app import train  # noqa: E402
from dpledger.flower.gate import ledger_gate  # noqa: E402
from dpledger.flower.local import template  # noqa: E402
from dpledger.flower.settings import SiloSettings  # noqa: E402
from dpledger.harness import running_server  # noqa: E402
from dpledger.wire.client import LedgerClient  # noqa: E402
from dpledger.wire.schemas import SiloDetail  # noqa: E402
from tests import gate_oracle  # noqa: E402
from tests.flower.federation import DELTA, write_silo_files  # noqa: E402

ADMIN = "gate-test-admin-key"
TRAIN, SIGMA, STEPS, BATCH = 60, 1.0, 2, 12


def run(rounds: int) -> list[tuple[float, float, int]]:
    """`rounds` rounds of this silo's DP-SGD, as (q, σ, steps) for the gate oracle."""
    return [(BATCH / TRAIN, SIGMA, STEPS * rounds)]


def budget_for_rounds(ledger: str, rounds: int) -> float:
    """A budget whose silo admits exactly `rounds` rounds (its filter follows from the budget, so
    probe silos find the fixed point; the filter of a silo is a function of budget, δ and size)."""
    probes = iter(range(100))
    with LedgerClient(ledger, ADMIN) as admin:
        def create(budget: float) -> SiloDetail:
            made = admin.create_silo(name=f"probe-{rounds}-{budget!r}-{next(probes)}", epsilon=budget, delta=DELTA,
                                     dataset_size=TRAIN)
            return admin.silo(made.id)

        probe = gate_oracle.budget_admitting(create, run(rounds), run(rounds + 1), delta=DELTA)
    return float(probe.epsilon)


@pytest.fixture(autouse=True)
def task_identity() -> Iterator[None]:
    """What a `flwr-clientapp` process sets before it handles a message (messages read it)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 7, 1
    yield
    TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("gate")
    with running_server(database_url=f"sqlite:///{folder / 'ledger.db'}", admin_key=ADMIN) as url:
        yield url


def silo_context(ledger: str, folder: Path, *, budget: float) -> tuple[int, Context]:
    (data,) = write_silo_files(folder, silos=1, train=TRAIN, test=10)
    with LedgerClient(ledger, ADMIN) as admin:
        created = admin.create_silo(name=folder.name, epsilon=budget, delta=DELTA, dataset_size=TRAIN)
        job_id = admin.create_job(name=folder.name, silo_ids=[created.id])
    key_file = folder / "silo.key"
    key_file.write_text(created.api_key)
    node_config = {"ledger-url": ledger, "silo-id": created.id, "key-file": str(key_file), "data-path": str(data),
                   "noise-multiplier": SIGMA}
    return job_id, Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})


RUN_KEY = "0123456789abcdef"


def train_message(job_id: int, round_index: int, *, algorithm: str = "fedavg", server_noise: float = 1.0,
                  attempt: int = 0) -> Message:
    config = ConfigRecord({"job-id": job_id, "round": round_index, "algorithm": algorithm, "seed": 0, "local-steps": STEPS,
                           "batch-size": BATCH, "lr": 0.5, "clip-norm": 1.0, "lam": 0.5, "server-noise": server_noise,
                           "run-key": RUN_KEY, "attempt": attempt})
    broadcast = {"mean" if algorithm in ("pmtl", "mrmtl") else "global": template(seed=0).initial()}
    content = RecordDict({records.ARRAYS: family.to_record(broadcast), records.CONFIG: config})
    return Message(content, 7, MessageType.TRAIN, group_id=str(round_index))


class Counting:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, message: Message, context: Context) -> Message:
        self.calls += 1
        return train(message, context)


def test_a_train_message_delivered_twice_trains_once(ledger: str, tmp_path: Path) -> None:
    job_id, context = silo_context(ledger, tmp_path, budget=10.0)
    trainer = Counting()
    message = train_message(job_id, 0)
    first = ledger_gate(message, context, trainer)
    second = ledger_gate(message, context, trainer)
    assert records.reply_status(first) == records.TRAINED
    assert records.reply_status(second) == records.REPLAYED
    assert trainer.calls == 1
    assert set(second.content.keys()) == {records.STATUS}  # no model, no numbers
    silo_id = int(context.node_config["silo-id"])
    with LedgerClient(ledger, ADMIN) as admin:
        detail = admin.silo(silo_id)
        history = admin.history(silo_id)
    assert detail.epsilon_committed == pytest.approx(gate_oracle.dpsgd_epsilon(detail, run(1), delta=DELTA), rel=1e-9)
    assert [e.event for e in history].count("reserve") == 1
    # The silo's norm reached the ledger under its own key, and never the reply.
    assert "update-norm" not in str(first.content.config_records) and "update-norm" not in str(first.content.metric_records)
    assert records.APPROVAL not in context.state.config_records


def test_a_denial_never_reaches_the_trainer_and_says_only_declined(ledger: str, tmp_path: Path) -> None:
    job_id, context = silo_context(ledger, tmp_path, budget=budget_for_rounds(ledger, 1))
    trainer = Counting()
    assert records.reply_status(ledger_gate(train_message(job_id, 0), context, trainer)) == records.TRAINED
    refusal = ledger_gate(train_message(job_id, 1), context, trainer)
    assert trainer.calls == 1
    assert refusal.content.config_records[records.STATUS] == ConfigRecord({records.STATUS: records.DECLINED})
    assert list(refusal.content.keys()) == [records.STATUS]


def test_the_trainer_refuses_a_round_without_the_gates_approval(ledger: str, tmp_path: Path) -> None:
    job_id, context = silo_context(ledger, tmp_path, budget=10.0)
    with pytest.raises(RuntimeError, match="no ledger approval"):
        train(train_message(job_id, 0), context)


def test_silo_settings_come_from_the_node_config_only(ledger: str, tmp_path: Path) -> None:
    job_id, context = silo_context(ledger, tmp_path, budget=10.0)
    # The run config (written by the server side) names another key file and σ: ignored.
    context.run_config = {"key-file": "/nonexistent", "noise-multiplier": 1e-3}
    del context.node_config["key-file"]
    trainer = Counting()
    reply = ledger_gate(train_message(job_id, 0), context, trainer)
    assert records.reply_status(reply) == records.FAILED and trainer.calls == 0


def test_a_pmtl_round_charges_the_servers_gaussian_at_record_level(ledger: str, tmp_path: Path) -> None:
    """PMTL: the silo trains without noise and is charged the server's Gaussian on the sum of clipped
    updates, z/2 for one record (an update moves by up to 2γ), with no amplification."""
    job_id, context = silo_context(ledger, tmp_path, budget=10.0)
    trainer = Counting()
    for round_index in range(2):
        reply = ledger_gate(train_message(job_id, round_index, algorithm="pmtl", server_noise=3.0), context, trainer)
        assert records.reply_status(reply) == records.TRAINED
    # The personal model stays at the silo, in its own state folder (beside its data by default).
    state = SiloStates(SiloSettings.of_node(context.node_config).state_dir, RUN_KEY).latest()
    assert state is not None and "personal" in state
    charged = gate_oracle.event_curve(de.SelfComposedDpEvent(de.GaussianDpEvent(1.5), 2))
    with LedgerClient(ledger, ADMIN) as admin:
        detail = admin.silo(int(context.node_config["silo-id"]))
    expected = gate_oracle.proven_epsilon(gate_oracle.filter_pairs(detail), charged, delta=DELTA)
    assert detail.epsilon_committed == pytest.approx(expected, rel=1e-9)


def test_a_resumed_run_trains_the_interrupted_round_under_a_charge_of_its_own(ledger: str, tmp_path: Path) -> None:
    """A round whose charge was committed in a stopped run (it may have read data) is trained again by
    the resumed run (attempt 1) under a new charge, from the silo's state before that round; the
    same message of the stopped run stays a replay."""
    job_id, context = silo_context(ledger, tmp_path, budget=10.0)
    trainer = Counting()
    for round_index in range(2):
        reply = ledger_gate(train_message(job_id, round_index, algorithm="mrmtl"), context, trainer)
        assert records.reply_status(reply) == records.TRAINED
    states = SiloStates(SiloSettings.of_node(context.node_config).state_dir, RUN_KEY)
    after_first = states.before(1)
    assert after_first is not None
    assert records.reply_status(ledger_gate(train_message(job_id, 1, algorithm="mrmtl"), context, trainer)) == records.REPLAYED
    resumed = ledger_gate(train_message(job_id, 1, algorithm="mrmtl", attempt=1), context, trainer)
    assert records.reply_status(resumed) == records.TRAINED and trainer.calls == 3
    before = states.before(1)
    assert before is not None and all(torch.equal(before[k], after_first[k]) for k in after_first)  # round 0's state kept
    silo_id = int(context.node_config["silo-id"])
    with LedgerClient(ledger, ADMIN) as admin:
        detail = admin.silo(silo_id)
        charges = admin.charges(silo_id)
    assert sorted(c.round for c in charges) == [0, 1, 1] and {c.status.value for c in charges} == {"committed"}
    assert detail.epsilon_committed == pytest.approx(gate_oracle.dpsgd_epsilon(detail, run(3), delta=DELTA), rel=1e-9)


def test_a_silos_data_and_halves_are_built_once_per_run(ledger: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate and the ClientApp share one read of the data file and one build of the halves and
    engine, and a ClientApp process that lives for the whole run (Flower's simulation engine) keeps
    them from round to round; another run builds its own."""
    from dpledger.flower import built

    loads, builds = Counting(), Counting()
    real_load, real_parts = built.load_silo_file, family.silo_parts

    def load(path: Path) -> object:
        loads.calls += 1
        return real_load(path)

    def parts(*args: object, **kwargs: object) -> object:
        builds.calls += 1
        return real_parts(*args, **kwargs)  # type: ignore[arg-type]  # passed through as the gate gave them

    monkeypatch.setattr(built, "load_silo_file", load)
    monkeypatch.setattr(family, "silo_parts", parts)
    job_id, context = silo_context(ledger, tmp_path, budget=50.0)
    for round_index in range(2):
        assert records.reply_status(ledger_gate(train_message(job_id, round_index), context, train)) == records.TRAINED
    assert (loads.calls, builds.calls) == (1, 1)
    later = Context(run_id=2, node_id=7, node_config=context.node_config, state=context.state, run_config={})
    assert records.reply_status(ledger_gate(train_message(job_id, 2), later, train)) == records.TRAINED
    assert (loads.calls, builds.calls) == (2, 2)
