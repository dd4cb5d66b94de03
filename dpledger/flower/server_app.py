"""The ServerApp: one ledger job per run, FedAvg, MR-MTL, PMTL, PFA or FedHDP over the silos still training.

PFA and FedHDP (`grouped`): a charged warm-start round, then the groups the ledger clusters from
that round's norms, read once with the coordinator key and kept for the rest of the run.

It holds a coordinator key only (create the job; read groups), so nothing it could log or forward
holds a budget, an ε or a norm: silos answer "declined" when they stop, and report their norms to
the ledger themselves. A silo that declines gets no more train messages. One that failed, did not
answer within the round's timeout, or whose SuperNode is gone is asked again in the next round: a
SuperNode that comes back (under a new node id) is found by asking new nodes for their silo id at
the start of each round. Its ledger keeps whatever the lost round reserved spent.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import asdict, dataclass, field

import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from dpledger.flower import grouped, records
from dpledger.flower.local import template
from dpledger.flower.pmtl import server_step
from dpledger.flower.settings import RunSettings
from dpledger.trainer.client import LedgerClient

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


def _exchange(grid: Grid, messages: list[Message], timeout: float) -> list[Message]:
    """Grid.send_and_receive, pulling every 0.1 s: Flower 1.41's own pulls every 3 s, which rounds
    every round up to a multiple of 3 s (flwr/superlink/grid/http_grid.py)."""
    pending = set(grid.push_messages(messages))
    deadline = time.monotonic() + timeout
    replies: list[Message] = []
    while pending and time.monotonic() < deadline:
        pulled = list(grid.pull_messages(pending))
        replies.extend(pulled)
        pending.difference_update(reply.metadata.reply_to_message_id for reply in pulled)
        if pending:
            time.sleep(REPLY_POLL_SECONDS)
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


def _ask_silo_ids(grid: Grid, nodes: list[int], timeout: float) -> dict[int, int]:
    asks = [Message(RecordDict(), node, MessageType.QUERY, group_id="silo-id") for node in nodes]
    silos: dict[int, int] = {}
    for reply in _exchange(grid, asks, timeout):
        if not reply.has_error() and records.CONFIG in reply.content.config_records:
            silo_id = reply.content.config_records[records.CONFIG].get("silo-id")
            if isinstance(silo_id, int):
                silos[reply.metadata.src_node_id] = silo_id
    return silos


SILO_ID_ASKS = 3  # how many rounds a silent new node is asked its silo id before it is left alone


def _current_nodes(grid: Grid, silos: dict[int, int], job_silos: list[int], timeout: float,
                   asks: dict[int, int]) -> dict[int, int]:
    """Silo id → its connected node now. A node not heard from (a restarted SuperNode comes back under
    a new id) is asked its silo id, in up to SILO_ID_ASKS rounds while it stays silent; `silos`
    (node → silo) keeps every node that answered for one of the job's silos, in the order found, so
    a silo's newest node wins."""
    connected = set(grid.get_node_ids())
    new = sorted(n for n in connected if asks.get(n, 0) < SILO_ID_ASKS)
    if new:
        for node in new:
            asks[node] = asks.get(node, 0) + 1
        for node, silo in _ask_silo_ids(grid, new, timeout).items():
            asks[node] = SILO_ID_ASKS  # it answered: never asked again
            if silo in job_silos:
                log.info("silo %d answers on node %d", silo, node)
                silos.pop(node, None)
                silos[node] = silo
    return {silo: node for node, silo in silos.items() if node in connected}


@app.main()
def main(grid: Grid, context: Context) -> None:
    settings = RunSettings.from_run_config(context.run_config)
    nodes = _wait_for_nodes(grid, settings.min_nodes)
    silos = _ask_silo_ids(grid, nodes, settings.round_timeout)
    if len(silos) < settings.min_nodes:
        raise RuntimeError(f"{len(silos)} silos answered, fewer than min-nodes={settings.min_nodes}")
    with LedgerClient(settings.ledger_url, settings.coordinator_key()) as ledger:
        job_id = ledger.create_job(name=f"flower-run-{context.run_id}", silo_ids=sorted(silos.values()))
    run = RunLog(job_id=job_id, algorithm=settings.algorithm, silos=silos)
    log.info("job %d: %s over %d silos, %d rounds", job_id, settings.algorithm, len(silos), settings.rounds)

    model = template(seed=settings.seed)
    shared = model.initial()  # FedAvg: the global model; MR-MTL: the mean of the personal models
    job_silos = sorted(silos.values())
    latest = {silo: shared.clone() for silo in job_silos}  # MR-MTL: each silo's last personal model
    active = set(job_silos)  # every silo that has not declined
    # Asked once already at the start; those that answered are never asked again.
    asked_nodes = {node: 1 for node in nodes} | {node: SILO_ID_ASKS for node in silos}
    for round_index in range(settings.rounds):
        if not active:
            log.info("round %d: no silo left to train", round_index + 1)
            break
        node_of = _current_nodes(grid, silos, job_silos, settings.round_timeout, asked_nodes)
        config = ConfigRecord({
            "job-id": job_id, "round": round_index, "algorithm": settings.algorithm, "seed": settings.seed,
            "local-steps": settings.local_steps, "batch-size": settings.batch_size, "lr": settings.lr,
            "clip-norm": settings.clip_norm, "lam": settings.lam, "server-noise": settings.server_noise,
        })
        asked = sorted(active)  # PMTL averages over the silos asked, a fixed count (see pmtl.server_step)
        messages = [
            Message(RecordDict({records.ARRAYS: records.to_record(shared), records.CONFIG: config}), node_of[silo],
                    MessageType.TRAIN, group_id=str(round_index))
            for silo in asked if silo in node_of
        ]
        started = time.perf_counter()
        replies = {silos.get(reply.metadata.src_node_id): reply
                   for reply in _exchange(grid, messages, settings.round_timeout)}
        entry = RoundLog(round=round_index, status={}, seconds=time.perf_counter() - started, train_seconds={}, ledger_seconds={})
        trained: list[torch.Tensor] = []
        trained_silos: list[int] = []
        for silo in asked:
            reply = replies.get(silo)
            status = (records.reply_status(reply) if reply is not None
                      else "no reply" if silo in node_of else "no node")
            entry.status[silo] = status
            if reply is not None:
                run.reply_records.append(_public_values(reply))
            if reply is not None and status == records.TRAINED:
                params = records.from_record(reply.content.array_records[records.ARRAYS])
                trained.append(params)
                trained_silos.append(silo)
                latest[silo] = params
                metrics = reply.content.metric_records[records.METRICS]
                entry.train_seconds[silo] = float(metrics["train-seconds"])  # type: ignore[arg-type]  # a float the silo wrote
                entry.ledger_seconds[silo] = float(metrics["ledger-seconds"])  # type: ignore[arg-type]  # idem
            elif status == records.DECLINED:
                active.discard(silo)  # over its budget: final, the silo spends no more
        if settings.algorithm == "fedavg" and trained:
            shared = torch.stack(trained).mean(0)
        elif settings.algorithm in grouped.GROUPED and round_index == grouped.WARM_START_ROUND:
            # Liu et al. 2023 §4.1: the warm-start round only collects; every silo reported its norm to
            # the ledger before replying, so the groups are complete now. Read once, never again.
            with LedgerClient(settings.ledger_url, settings.coordinator_key()) as ledger:
                service_groups = ledger.groups(job_id, round_index)
            run.groups = grouped.fixed_groups(service_groups, sorted(silos.values()))
            log.info("job %d: privacy groups %s", job_id, run.groups)
        elif settings.algorithm in grouped.GROUPED and trained:
            updates = torch.stack(trained) - shared
            shared = shared + grouped.aggregate(settings.algorithm, updates, [run.groups[s] for s in trained_silos])
        elif settings.algorithm == "mrmtl":
            # The mean of all personal models, a stopped silo's frozen one included (post-processing).
            shared = torch.stack([latest[silo] for silo in job_silos]).mean(0)
        elif settings.algorithm == "pmtl":
            # Hu et al., "Private Multi-Task Learning", Alg. 1 line 8: clip each asked silo's update,
            # sum those that trained, add N(0, z²γ²), divide by the number asked. The noise is drawn
            # whatever answered, from OS randomness no silo can predict.
            took_part = torch.tensor([entry.status[silo] == records.TRAINED for silo in asked])
            shared = server_step(shared, torch.stack([latest[silo] for silo in asked]), took_part,
                                 update_clip=settings.update_clip, server_noise=settings.server_noise,
                                 generator=torch.Generator().manual_seed(secrets.randbits(63)))
        run.rounds.append(entry)
        counts = {s: sum(v == s for v in entry.status.values()) for s in set(entry.status.values())}
        log.info("round %d: %s in %.2f s", round_index + 1, counts, entry.seconds)

    evaluations = [
        Message(RecordDict({records.ARRAYS: records.to_record(shared),
                            records.CONFIG: ConfigRecord({"algorithm": settings.algorithm, "seed": settings.seed})}),
                node, MessageType.EVALUATE, group_id="evaluate")
        for node in sorted(_current_nodes(grid, silos, job_silos, settings.round_timeout, asked_nodes).values())
    ]
    for reply in _exchange(grid, evaluations, settings.round_timeout):
        if not reply.has_error() and records.METRICS in reply.content.metric_records:
            run.accuracy[silos[reply.metadata.src_node_id]] = float(reply.content.metric_records[records.METRICS]["accuracy"])  # type: ignore[arg-type]  # a float the silo wrote
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
        raise RuntimeError(f"job {job_id}: no silo trained any round (round 0: {', '.join(statuses) or 'no round'}); "
                           "the run failed")
