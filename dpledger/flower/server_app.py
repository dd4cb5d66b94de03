"""The ServerApp: one ledger job per run, any algorithm of the registry over the silos still training.

The algorithm's server half runs inside `LedgerStrategy`, a Flower strategy (`configure_train` /
`aggregate_train`, driven by Flower's own `Strategy.start` loop): it broadcasts what the server half
says, and folds the uploads of the silos that trained into it. PFA and FedHDP (coordinated): a
charged warm-start round, then the groups the ledger clusters from that round's norms, read once
with the coordinator key and kept for the rest of the run.

It holds a coordinator key only (create the job; read groups), so nothing it could log or forward
holds a budget, an ε or a norm: silos answer "declined" when they stop, and report their norms to
the ledger themselves. A silo that declines gets no more train messages. One that failed, did not
answer within the round's timeout, or whose SuperNode is gone is asked again in the next round: a
SuperNode that comes back (under a new node id) is found by asking new nodes for their silo id at
the start of each round. Its ledger keeps whatever the lost round reserved spent. A round that no
silo replied to at all stops the run (SilentRound): the machine is too busy for the run's timeouts.

After each round it aggregated it writes a checkpoint beside the `out` JSON (checkpoint.py); a run
started with `resume = true` continues that job from the first round not aggregated.
"""

from __future__ import annotations

import functools
import json
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy
from flwr.supercore.exit import add_exit_handler
from flwr.supercore.run import Run

from dpledger.flower import checkpoint, family, grouped, records
from dpledger.flower.local import template
from dpledger.flower.settings import RunSettings
from dpledger.trainer.federated.config import STREAM_INIT, derive_seed
from dpledger.trainer.federated.halves import ServerHalf, ServerStart
from dpledger.trainer.federated.pfa import GroupServer
from dpledger.wire.client import LedgerClient

# Under "flwr", so the lines reach the SuperLink log and `flwr run --stream` like Flower's own.
log = logging.getLogger("flwr.dpledger.server")
app = ServerApp()
NODE_WAIT_SECONDS = 120.0


@dataclass
class RoundLog:
    round: int
    status: dict[int, str]  # silo id → status (absent: not asked)
    seconds: float  # wall time of the round, as the server sees it
    train_seconds: dict[int, float]
    ledger_seconds: dict[int, float]
    timeout: float = 0.0  # the longest the round would wait for a reply (Pace, FastGrid.send_and_receive)


@dataclass
class RunLog:
    job_id: int
    algorithm: str
    silos: dict[int, int]  # Flower node id → silo id
    rounds: list[RoundLog] = field(default_factory=list)
    accuracy: dict[int, float] = field(default_factory=dict)
    reply_records: list[dict[str, object]] = field(default_factory=list)  # every non-array value the silos sent
    # PFA / FedHDP: silo id → privacy group (0 = least noisy), as read from the ledger after the warm start.
    groups: dict[int, int] = field(default_factory=dict)


def _wait_for_nodes(grid: Grid, count: int) -> list[int]:
    deadline = time.monotonic() + NODE_WAIT_SECONDS
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= count or time.monotonic() > deadline:
            return nodes
        time.sleep(0.5)


REPLY_POLL_SECONDS = 0.1
# A long wait pulls less often: each pull is a call the SuperLink serves, CPU that the ClientApps
# being waited for need on a busy machine. Every REPLY_POLL_SHARE of the time waited so far (a
# reply is then seen at most 5% late), at least REPLY_POLL_SECONDS and at most REPLY_POLL_MAX_SECONDS.
REPLY_POLL_SHARE = 0.05
REPLY_POLL_MAX_SECONDS = 1.0
# A round waits round-timeout beyond this many times the slowest start-up seen (Pace): room for a
# machine that grows busier during the run.
STARTUP_SLACK = 2.0


@dataclass
class Pace:
    """How slowly this federation's ClientApps start, measured in this run: each message starts a
    ClientApp process (Flower, torch and the app imported anew), minutes on a busy machine, and
    `round-timeout` is meant for the training, not that. Measured on every first contact (a silo-id
    query: start-up alone) and on every trained reply (its wait less the train and ledger seconds
    the silo reported); a round then waits `round-timeout` + STARTUP_SLACK × the slowest, the
    addition capped at `first-contact-timeout`."""

    ceiling: float  # first-contact-timeout: the longest start-up the run's settings allow
    startup: float = 0.0
    allowed: float = 0.0  # the last exchange's deadline, seconds after its push (FastGrid)

    def saw(self, seconds: float) -> None:
        self.startup = max(self.startup, seconds)

    def timeout(self, round_timeout: float) -> float:
        return round_timeout + min(STARTUP_SLACK * self.startup, self.ceiling)


def _exchange(grid: Grid, messages: Iterable[Message], timeout: float | Callable[[list[Message]], float],
              waited: dict[str, float]) -> list[Message]:
    """Grid.send_and_receive, pulling every 0.1 s at first, then every 5% of the time waited (up to
    1 s): Flower 1.41's own pulls every 3 s, which rounds every round up to a multiple of 3 s
    (flwr/superlink/grid/http_grid.py). `timeout`: seconds from the push, or a function of the
    replies pulled so far (read again after each pull that brings one). `waited` gets each reply's
    wait in seconds (by the id of the message it answers)."""
    pending = set(grid.push_messages(messages))
    pushed = time.monotonic()
    replies: list[Message] = []
    deadline = pushed + (timeout(replies) if callable(timeout) else timeout)
    while pending and time.monotonic() < deadline:
        pulled = list(grid.pull_messages(pending))
        replies.extend(pulled)
        pending.difference_update(reply.metadata.reply_to_message_id for reply in pulled)
        waited.update((reply.metadata.reply_to_message_id, time.monotonic() - pushed) for reply in pulled)
        if pulled and callable(timeout):
            deadline = pushed + timeout(replies)
        if pending:
            waited_so_far = time.monotonic() - pushed
            time.sleep(min(max(REPLY_POLL_SECONDS, REPLY_POLL_SHARE * waited_so_far), REPLY_POLL_MAX_SECONDS))
    return replies


def _public_values(reply: Message) -> dict[str, object]:
    if reply.has_error():
        return {"error-code": reply.error.code}
    values: dict[str, object] = {}
    for name, config in reply.content.config_records.items():
        values.update({f"{name}.{k}": v for k, v in config.items()})
    for name, metrics in reply.content.metric_records.items():
        values.update({f"{name}.{k}": v for k, v in metrics.items()})
    return values


def _ask_silo_ids(grid: Grid, nodes: list[int], timeout: float, pace: Pace) -> dict[int, int]:
    asks = [Message(RecordDict(), node, MessageType.QUERY, group_id="silo-id") for node in nodes]
    silos: dict[int, int] = {}
    waited: dict[str, float] = {}
    replies = _exchange(grid, asks, timeout, waited)
    for seconds in waited.values():
        pace.saw(seconds)
    for reply in replies:
        if not reply.has_error() and records.CONFIG in reply.content.config_records:
            silo_id = reply.content.config_records[records.CONFIG].get("silo-id")
            if isinstance(silo_id, int):
                silos[reply.metadata.src_node_id] = silo_id
    return silos


SILO_ID_ASKS = 3  # how many rounds a silent new node is asked its silo id before it is left alone


def _current_nodes(grid: Grid, silos: dict[int, int], job_silos: list[int], timeout: float,
                   asks: dict[int, int], pace: Pace) -> dict[int, int]:
    """Silo id → its connected node now. A node not heard from (a restarted SuperNode comes back under
    a new id) is asked its silo id, in up to SILO_ID_ASKS rounds while it stays silent; `silos`
    (node → silo) keeps every node that answered for one of the job's silos, in the order found, so
    a silo's newest node wins."""
    connected = set(grid.get_node_ids())
    new = sorted(n for n in connected if asks.get(n, 0) < SILO_ID_ASKS)
    if new:
        for node in new:
            asks[node] = asks.get(node, 0) + 1
        for node, silo in _ask_silo_ids(grid, new, timeout, pace).items():
            asks[node] = SILO_ID_ASKS  # it answered: never asked again
            if silo in job_silos:
                log.info("silo %d answers on node %d", silo, node)
                silos.pop(node, None)
                silos[node] = silo
    return {silo: node for node, silo in silos.items() if node in connected}


class FastGrid(Grid):
    """The run's grid in Strategy.start's loop: replies pulled every 0.1 s (`_exchange`), each
    round's timeout stretched by the start-up its ClientApps take (Pace), which it measures again on
    every trained reply."""

    def __init__(self, grid: Grid, pace: Pace) -> None:
        self.grid = grid
        self.pace = pace

    @property
    def run(self) -> Run:
        return self.grid.run

    def set_run(self, run: Run) -> None:
        self.grid.set_run(run)

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        round_timeout = 3600.0 if timeout is None else timeout
        waited: dict[str, float] = {}
        measured: set[str] = set()

        def deadline(replies: list[Message]) -> float:
            """Until a reply comes, the round cannot tell a machine grown slower since the last
            measurement (the load of a shared server changes within a run) from silent silos, and a
            charge spent on an update that comes too late is ε lost: it waits as long as the run's
            settings allow a start-up (round-timeout + first-contact-timeout). Each reply measures the
            start-up again, and the round then waits what Pace allows for it."""
            for reply in replies:
                message_id = reply.metadata.reply_to_message_id
                if message_id not in measured:
                    measured.add(message_id)
                    self._measure(reply, waited[message_id])
            self.pace.allowed = self.pace.timeout(round_timeout) if replies else round_timeout + self.pace.ceiling
            return self.pace.allowed

        return _exchange(self.grid, messages, deadline, waited)

    def _measure(self, reply: Message, waited: float) -> None:
        """A trained reply's start-up: its wait less the train and ledger seconds the silo reported."""
        if reply.has_error() or records.METRICS not in reply.content.metric_records:
            return
        metrics = reply.content.metric_records[records.METRICS]
        busy = [metrics.get(name) for name in ("train-seconds", "ledger-seconds")]
        if all(isinstance(seconds, float) for seconds in busy):
            self.pace.saw(waited - sum(busy))  # type: ignore[arg-type]  # floats, checked


class LedgerStrategy(Strategy):
    """A Flower strategy around an algorithm's server half, over the job's silos (by ledger silo id,
    in id order: position k of the server half is the k-th). It asks every silo that has not
    declined (and that the server half asks this round), on whichever node answers for it now."""

    def __init__(self, settings: RunSettings, server: ServerHalf, run: RunLog, asked_nodes: dict[int, int], *,
                 job_silos: list[int], active: set[int], done: int, run_key: str, attempt: int, pace: Pace) -> None:
        self.settings = settings
        self.pace = pace
        self.server = server
        self.run = run
        self.job_silos = job_silos
        self.active = active  # every silo that has not declined
        self.asked_nodes = asked_nodes
        # A resumed run: Flower's rounds 1, 2… are the job's rounds done + 1, done + 2…
        self.done = done
        self.run_key = run_key  # names each silo's state file of this run (and of its resumptions)
        self.attempt = attempt
        self._asked: list[int] = []
        self._node_of: dict[int, int] = {}
        self._started = 0.0

    def _timeout(self) -> float:
        return self.pace.timeout(self.settings.round_timeout)

    def summary(self) -> None:
        log.info("job %d: %s over %d silos, %d rounds", self.run.job_id, self.settings.algorithm,
                 len(self.job_silos), self.settings.rounds)

    def _round_config(self, round_index: int) -> ConfigRecord:
        s = self.settings
        return ConfigRecord({"job-id": self.run.job_id, "round": round_index, "algorithm": s.algorithm, "seed": s.seed,
                             "local-steps": s.local_steps, "batch-size": s.batch_size, "lr": s.lr,
                             "clip-norm": s.clip_norm, "run-key": self.run_key, "attempt": self.attempt,
                             **s.options})

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        round_index = server_round - 1 + self.done
        if not self.active:
            log.info("round %d: no silo left to train", round_index + 1)
            self._asked = []
            return []
        node_of = self._node_of = _current_nodes(grid, self.run.silos, self.job_silos, self._timeout(),
                                                 self.asked_nodes, self.pace)
        asks = self.server.asks(round_index).tolist()
        self._asked = [silo for k, silo in enumerate(self.job_silos) if silo in self.active and asks[k]]
        content = family.to_record(self.server.broadcast(round_index))
        round_config = self._round_config(round_index)
        self._started = time.perf_counter()
        return [Message(RecordDict({records.ARRAYS: content, records.CONFIG: round_config}), node_of[silo],
                        MessageType.TRAIN, group_id=str(round_index))
                for silo in self._asked if silo in node_of]

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        round_index = server_round - 1 + self.done
        if not self._asked:
            return None, None
        by_silo = {self.run.silos.get(reply.metadata.src_node_id): reply for reply in replies}
        entry = RoundLog(round=round_index, status={}, seconds=time.perf_counter() - self._started, train_seconds={},
                         ledger_seconds={}, timeout=self.pace.allowed)
        uploads: list[dict[str, torch.Tensor]] = []
        members: list[int] = []
        for silo in self._asked:
            reply = by_silo.get(silo)
            status = records.reply_status(reply) if reply is not None else ("no reply" if silo in self._node_of else "no node")
            entry.status[silo] = status
            if reply is None:
                continue
            self.run.reply_records.append(_public_values(reply))
            if status == records.TRAINED:
                uploads.append(family.from_record(reply.content.array_records[records.ARRAYS]))
                members.append(self.job_silos.index(silo))
                metrics = reply.content.metric_records[records.METRICS]
                entry.train_seconds[silo] = float(metrics["train-seconds"])  # type: ignore[arg-type]  # a float the silo wrote
                entry.ledger_seconds[silo] = float(metrics["ledger-seconds"])  # type: ignore[arg-type]  # idem
            elif status == records.DECLINED:
                self.active.discard(silo)  # over its budget: final, the silo spends no more
        if members:
            self.server.aggregate(round_index, torch.tensor(members), family.stack(uploads))
        if isinstance(self.server, GroupServer) and round_index == grouped.WARM_START_ROUND:
            # Liu et al. 2023 §4.1: the warm-start round only collects; every silo reported its norm to
            # the ledger before replying, so the groups are complete now. Read once, never again.
            with LedgerClient(self.settings.ledger_url, self.settings.coordinator_key()) as ledger:
                service_groups = ledger.groups(self.run.job_id, round_index)
            self.run.groups = grouped.fixed_groups(service_groups, self.job_silos)
            self.server.set_groups([self.run.groups[silo] for silo in self.job_silos])
            log.info("job %d: privacy groups %s", self.run.job_id, self.run.groups)
        self.run.rounds.append(entry)
        counts = {s: sum(v == s for v in entry.status.values()) for s in set(entry.status.values())}
        log.info("round %d: %s in %.2f s (replies waited for up to %.0f s)", round_index + 1, counts, entry.seconds,
                 entry.timeout)
        self.save(round_index + 1)
        sent = [silo for silo in self._asked if silo in self._node_of]
        if sent and not any(silo in by_silo for silo in sent):
            # Not one silo answered in all the time the settings allow: the next round would wait as
            # long for as little, while each silo's gate may spend another charge on an update that
            # arrives too late. Stop here; resume=true continues from this checkpoint.
            raise SilentRound(f"round {round_index + 1}: none of the {len(sent)} silos asked replied within "
                              f"{entry.timeout:.0f} s")
        return None, MetricRecord({status: count for status, count in counts.items()})

    def save(self, completed: int) -> None:
        """The checkpoint after `completed` rounds (beside `out`; none without it)."""
        if self.settings.out is not None:
            checkpoint.ServerCheckpoint(
                job_id=self.run.job_id, run_key=self.run_key, attempt=self.attempt, fingerprint=self.settings.fingerprint(),
                completed=completed, run=self.run, job_silos=self.job_silos, active=sorted(self.active),
                server=self.server,
            ).save(checkpoint.path_for(self.settings.out))

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        last = self.settings.rounds
        if server_round + self.done != last:
            return []  # one evaluation, after the last round
        content = family.to_record(self.server.broadcast(last))
        evaluate_config = self._round_config(last)
        nodes = _current_nodes(grid, self.run.silos, self.job_silos, self._timeout(), self.asked_nodes, self.pace)
        return [Message(RecordDict({records.ARRAYS: content, records.CONFIG: evaluate_config}), node,
                        MessageType.EVALUATE, group_id="evaluate") for node in sorted(nodes.values())]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        for reply in replies:
            if not reply.has_error() and records.METRICS in reply.content.metric_records:
                accuracy = reply.content.metric_records[records.METRICS]["accuracy"]
                self.run.accuracy[self.run.silos[reply.metadata.src_node_id]] = float(accuracy)  # type: ignore[arg-type]  # a float the silo wrote
        return None


class SilentRound(RuntimeError):
    """A round in which no silo asked replied at all: the run stops after it (its message says which)."""


class NothingTrained(RuntimeError):
    """The run stopped before round 1: too few silos answered (its message is the one line)."""


def _nothing_answered(settings: RunSettings, nodes: list[int], silos: dict[int, int]) -> None:
    """Fewer than min-nodes silos answered their first message: run.json says "nothing trained",
    and one line names the silent SuperNodes and the setting to raise."""
    silent = sorted(set(nodes) - set(silos))
    if len(nodes) < settings.min_nodes:
        why = (f"{len(nodes)} SuperNodes connected within {NODE_WAIT_SECONDS:g} s, fewer than "
               f"min-nodes={settings.min_nodes}: start the missing sites' SuperNodes (their logs say why they did not connect)")
    else:
        why = (f"{len(silos)} of {len(nodes)} SuperNodes answered within first-contact-timeout="
               f"{settings.first_contact_timeout:g} s, fewer than min-nodes={settings.min_nodes}; silent: "
               f"{', '.join(f'node {n}' for n in silent)} (see those SuperNodes' logs); raise first-contact-timeout "
               "(run config) on a busy machine")
    line = f"nothing trained: {why}"
    log.error(line)
    if settings.out is not None:
        settings.out.write_text(json.dumps({"outcome": "nothing trained", "reason": line, "silent_nodes": silent,
                                            "silos": {str(n): s for n, s in silos.items()}, "rounds": []}, indent=1))
    raise NothingTrained(line)


def _ended_early(settings: RunSettings, run: RunLog, outcome: str, why: str) -> None:
    """A run that ended before its last round: run.json up to the last round aggregated, and one line.
    Each silo settles the round it was in on its own (committed where it may have read data)."""
    then = ("continue it with the same run config and resume=true" if settings.out is not None
            else "start a new run to train more (set out to be able to resume one)")
    line = (f"job {run.job_id} {outcome} after {len(run.rounds)} of {settings.rounds} rounds ({why}): "
            f"{'the out JSON holds those rounds; ' if settings.out is not None else ''}each silo's ledger holds "
            f"what its rounds spent; {then}")
    log.error(line)
    if settings.out is not None:
        settings.out.write_text(json.dumps({"outcome": outcome, "reason": line, **asdict(run)}, indent=1, default=str))


def _charged_by_the_silos(kind: str, members: torch.Tensor, mechanism: object) -> None:
    """A server query of the silos' data is charged by each silo's gate, from its own silo half."""


def _fresh_model(seed: int, silo: int) -> torch.Tensor:
    return template(seed=derive_seed(seed, STREAM_INIT, silo)).initial()


def _resumed(settings: RunSettings) -> checkpoint.ServerCheckpoint:
    """The stopped run's checkpoint (resume = true); ResumeRefused says in one line why not."""
    if settings.out is None:
        raise checkpoint.ResumeRefused("resume: set out to the stopped run's out JSON (its checkpoint lies beside it)")
    stopped = checkpoint.load(checkpoint.path_for(settings.out), settings.fingerprint())
    if stopped.completed >= settings.rounds:
        raise checkpoint.ResumeRefused(f"resume: job {stopped.job_id} already aggregated {stopped.completed} of "
                                       f"rounds={settings.rounds}; raise rounds to train more")
    return stopped


@app.main()
def main(grid: Grid, context: Context) -> None:
    settings = RunSettings.from_run_config(context.run_config)
    try:
        earlier = _resumed(settings) if settings.resume else None
    except checkpoint.ResumeRefused as refused:
        log.error("%s", refused)
        raise
    nodes = _wait_for_nodes(grid, settings.min_nodes)
    pace = Pace(ceiling=settings.first_contact_timeout)
    silos = _ask_silo_ids(grid, nodes, settings.first_contact_timeout, pace)
    if earlier is not None:  # the job's silos only, by silo id (their nodes are new)
        silos = {node: silo for node, silo in silos.items() if silo in earlier.job_silos}
    if len(silos) < settings.min_nodes:
        _nothing_answered(settings, nodes, silos)
    if earlier is None:
        with LedgerClient(settings.ledger_url, settings.coordinator_key()) as ledger:
            job_id = ledger.create_job(name=f"flower-run-{context.run_id}", silo_ids=sorted(silos.values()))
        run = RunLog(job_id=job_id, algorithm=settings.algorithm, silos=silos)
        job_silos = sorted(silos.values())
        model = template(seed=settings.seed)
        server = settings.halves.server(ServerStart(
            initial=model.initial(), num_silos=len(silos), fresh_model=functools.partial(_fresh_model, settings.seed),
            record=_charged_by_the_silos,
            # The server's own noise (PMTL's) from OS randomness no silo can predict.
            noise=torch.Generator().manual_seed(secrets.randbits(63)),
        ))
        active, done, run_key, attempt = set(job_silos), 0, secrets.token_hex(8), 0
    else:
        run, server, done, job_silos = earlier.run, earlier.server, earlier.completed, earlier.job_silos
        run.silos = silos
        active, run_key, attempt = set(earlier.active), earlier.run_key, earlier.attempt + 1
        log.info("job %d resumed at round %d of %d (start %d of the run)", run.job_id, done + 1, settings.rounds,
                 attempt + 1)
    job_id = run.job_id
    # Asked once already at the start; those that answered are never asked again.
    asked_nodes = {node: 1 for node in nodes} | {node: SILO_ID_ASKS for node in silos}
    strategy = LedgerStrategy(settings, server, run, asked_nodes, job_silos=job_silos, active=active, done=done,
                              run_key=run_key, attempt=attempt, pace=pace)
    strategy.save(done)
    ended = False

    def stopped() -> None:
        # Flower's exit handlers run on SIGINT/SIGTERM/SIGQUIT (a graceful exit, code 0-99) and at the
        # process's own end: only a run that has not ended by itself was stopped.
        if not ended:
            _ended_early(settings, run, "interrupted", "the ServerApp was stopped")

    add_exit_handler(stopped)
    try:
        strategy.start(grid=FastGrid(grid, pace), initial_arrays=family.to_record(server.broadcast(done)),
                       num_rounds=settings.rounds - done, timeout=settings.round_timeout)
    except SilentRound as round_silent:
        ended = True
        trained = any(e.status.get(s) == records.TRAINED for e in run.rounds for s in e.status)
        _ended_early(settings, run, "stopped" if trained else "nothing trained",
                     f"{round_silent}: on a machine this busy, raise first-contact-timeout (the longest start-up a round "
                     "waits for) or round-timeout")
        raise
    except Exception as error:
        ended = True
        _ended_early(settings, run, "failed", f"{type(error).__name__}: {error}")
        raise
    ended = True

    log.info("accuracy per silo: %s", {k: round(v, 3) for k, v in run.accuracy.items()})
    # The outcome, said once: "complete" (every silo trained every round), "partial", or "nothing
    # trained" (every silo declined, failed or was silent from round 0: the run learned nothing and fails).
    trained_rounds = {s: sum(e.status.get(s) == records.TRAINED for e in run.rounds) for s in silos.values()}
    outcome = ("nothing trained" if not any(trained_rounds.values())
               else "complete" if all(n == settings.rounds for n in trained_rounds.values()) else "partial")
    (log.info if outcome == "complete" else log.warning)(
        "job %d: outcome %s: rounds trained per silo %s of %d", job_id, outcome, trained_rounds, settings.rounds)
    if settings.out is not None:
        settings.out.write_text(json.dumps({"outcome": outcome, **asdict(run)}, indent=1, default=str))
    if outcome == "nothing trained":
        statuses = sorted({e.status[s] for e in run.rounds[:1] for s in e.status})
        silent = (f"; no reply came within {run.rounds[0].timeout:.0f} s: on a machine this busy, raise "
                  "first-contact-timeout (the longest start-up a round waits for) or round-timeout"
                  if "no reply" in statuses else "")
        raise RuntimeError(f"job {job_id}: no silo trained any round (round 1: {', '.join(statuses) or 'no round'})"
                           f"{silent}; the run failed")
