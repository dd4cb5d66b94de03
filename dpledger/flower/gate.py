"""The silo's ClientApp mod: every train message is approved by the silo's own ledger before it
may touch the data (Flower's `Mod = (Message, Context, call_next) -> Message`).

The one round protocol (`trainer/silo/rounds.py`): open the round → call_next → settle → report the
noisy update's norm, all with the silo's own key from its node config. A denial, a charge this
delivery did not reserve (a redelivered message whose round an earlier delivery reserved, even when
an answer was lost on the way), or any ledger error answers a constant status without calling the
trainer; nothing that could carry an ε or a budget (an exception's text included, which Flower would
forward to the server) leaves the silo. Once call_next starts, the round may have touched the data:
it is committed, never released, even when training fails (fail closed) or the process is stopped
(SIGINT, SIGTERM: the charge is committed before the process ends). The silo's own log says why,
with the refusal's numbers.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from flwr.app import ConfigRecord, Context, Message, MessageType
from flwr.clientapp.typing import ClientAppCallable

from dpledger.flower import records
from dpledger.flower.built import per_run
from dpledger.flower.settings import SettingsError, SiloSettings
from dpledger.trainer.silo.registered import size_mismatch
from dpledger.trainer.silo.rounds import Permit, open_round, refusal_line, spent_line
from dpledger.wire.client import LedgerClient
from dpledger.wire.errors import Denied, LedgerError, NotOwned

log = logging.getLogger("flwr.dpledger.silo")
# A line that names the silo's budget starts with SILO_LINE: it is the silo's own log. In Flower's
# simulation engine the ClientApps log into the run's one stream, beside the ServerApp's lines.
SILO_LINE = "[silo "


def ledger_job(job_id: int) -> str:
    """The job name a Flower run's charges carry (the ledger's job id, apart from other runners' names)."""
    return f"flower-job-{job_id}"


def _order(message: Message) -> tuple[int, int, int, dict[str, object]]:
    """(job id, round, attempt, the public config) of a train message; ValueError names what is wrong.
    `attempt` counts the run's resumptions: a resumed run's rounds are charged anew (`round_key`'s
    charge number), so a round stopped mid-training stays spent and is trained under a charge of its own."""
    if records.CONFIG not in message.content.config_records:
        raise ValueError("train message without a config record")
    record = message.content.config_records[records.CONFIG]
    config: dict[str, object] = {key: record[key] for key in record}
    values = []
    for key in ("job-id", "round", "attempt"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "job-id" else 0):
            raise ValueError(f"train config {key!r} must be a {'positive' if key == 'job-id' else 'non-negative'} "
                             f"integer. Found {value!r}.")
        values.append(value)
    return values[0], values[1], values[2], config


def ledger_gate(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    if message.metadata.message_type != MessageType.TRAIN:
        return call_next(message, context)
    try:
        silo = SiloSettings.of_node(context.node_config)
        job_id, round_index, attempt, config = _order(message)
        data = per_run.data(context, silo.data_path)
        # What the run's algorithm will query of this silo's data this round, from its silo half
        # (the same one the ClientApp then runs, built once per run): a DP-SGD round, IFCA's
        # selection composed with it, PMTL's record-level share of the server's Gaussian…
        planned = per_run.parts(context, silo.data_path, config, noise_multiplier=silo.noise_multiplier).round(config)
        mechanism = planned.mechanism()
        key = silo.api_key()
    except (SettingsError, ValueError) as error:
        log.error("round not run: %s", error)
        return records.status_reply(message, records.FAILED)

    with LedgerClient(silo.ledger_url, key) as ledger:
        started = time.perf_counter()
        try:
            mismatch = size_mismatch(registered=ledger.silo(silo.silo_id).dataset_size, records=data.size)
            if mismatch is not None:
                log.error("round not run: %s: %s", silo.data_path, mismatch)
                return records.status_reply(message, records.FAILED)
            permit = open_round(ledger, silo_id=silo.silo_id, job_id=ledger_job(job_id), round=round_index,
                                mechanism=mechanism, charge=attempt)
        except Denied as denied:
            log.warning("[silo %d] declines: %s", silo.silo_id, refusal_line(denied, round=round_index))
            return records.status_reply(message, records.DECLINED)
        except NotOwned as replay:
            log.warning("%s", replay)
            return records.status_reply(message, records.REPLAYED)
        except LedgerError as error:
            log.error("round %d not run: %s", round_index + 1, error)
            return records.status_reply(message, records.FAILED)
        ledger_seconds = time.perf_counter() - started
        try:
            with _stopping_interrupts():
                reply = _train(permit, message, context, call_next, job_id=job_id, mechanism=planned.mechanism_json())
        except KeyboardInterrupt:
            _settle_stopped(permit, silo.silo_id)
            raise  # the process is being stopped: its charge is settled, the rest is Flower's

        started = time.perf_counter()
        try:
            permit.settle()
        except LedgerError as error:
            log.error("round %d: commit of charge %d failed (%s); it stays reserved, i.e. spent", round_index + 1,
                      permit.charge_id, error)
        else:
            try:
                log.info("[silo %d] %s", silo.silo_id, spent_line(ledger.silo(silo.silo_id), round=round_index))
            except LedgerError as error:
                log.warning("[silo %d] round %d: settled; its ε could not be read back (%s)", silo.silo_id,
                            round_index + 1, error)
        outcome = context.state.config_records.pop(records.OUTCOME, None)
        norm = outcome.get("update-norm") if outcome is not None else None
        if isinstance(norm, float) and records.reply_status(reply) == records.TRAINED:
            try:
                ledger.report_norm(job_id, round_index, silo_id=silo.silo_id, l2_norm=norm)
            except LedgerError as error:
                log.error("round %d: the norm was not recorded (%s)", round_index + 1, error)
        ledger_seconds += time.perf_counter() - started
        if records.reply_status(reply) == records.TRAINED:
            reply.content.metric_records[records.METRICS]["ledger-seconds"] = ledger_seconds
        return reply


@contextmanager
def _stopping_interrupts() -> Iterator[None]:
    """SIGTERM (a SuperNode or an operator stopping the ClientApp) raises KeyboardInterrupt while the
    round holds its permit, as SIGINT does, so the round is settled before the process ends; Python's
    default would end it at once with the charge left reserved. Only the main thread sets handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _settle_stopped(permit: Permit, silo_id: int) -> None:
    """The one settle rule for a round stopped mid-training: it may have read data, so it is committed."""
    try:
        permit.settle()
        log.warning("[silo %d] round %d interrupted: charge %d committed (the round may have read data)", silo_id,
                    permit.round + 1, permit.charge_id)
    except LedgerError as error:
        log.error("round %d interrupted: charge %d stays reserved, i.e. spent (%s)", permit.round + 1,
                  permit.charge_id, error)


def _train(permit: Permit, message: Message, context: Context, call_next: ClientAppCallable, *, job_id: int,
           mechanism: str) -> Message:
    """call_next under the permit's approval, written into the silo's state for this round only."""
    context.state.config_records[records.APPROVAL] = ConfigRecord({
        "job-id": job_id, "round": permit.round, "mechanism": mechanism,
    })
    context.state.config_records.pop(records.OUTCOME, None)
    permit.touch()  # from here the ClientApp may read the data
    try:
        return call_next(message, context)
    except Exception:
        log.exception("round %d failed after approval; its charge is committed (it may have touched the data)",
                      permit.round + 1)
        return records.status_reply(message, records.FAILED)
    finally:
        del context.state.config_records[records.APPROVAL]
