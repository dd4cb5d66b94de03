"""The silo's ClientApp: the silo half of the run's algorithm (`trainer.federated.registry`), run
on the silo's own data only under the approval that `gate.ledger_gate` wrote into the silo's state
for this very round.

Every algorithm of the registry runs here the same way: build the silo half from the train
message's public settings, check that what it will query is what the gate had approved, train over
this one silo, keep its personal state in the silo's own state folder (`checkpoint.SiloStates`: a
resumed run, a new Flower run, continues from it), and send the upload (the already-private models
or updates the server half aggregates: post-processing)."""

from __future__ import annotations

import time

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from dpledger.flower import family, records
from dpledger.flower.built import per_run
from dpledger.flower.checkpoint import SiloStates
from dpledger.flower.gate import ledger_gate
from dpledger.flower.local import accuracy
from dpledger.flower.settings import SiloSettings

app = ClientApp(mods=[ledger_gate])


def _config(message: Message) -> dict[str, object]:
    record = message.content.config_records[records.CONFIG]
    return {key: record[key] for key in record}


@app.train()
def train(message: Message, context: Context) -> Message:
    approval = context.state.config_records.get(records.APPROVAL)
    config = _config(message)
    if approval is None or approval.get("round") != config.get("round") or approval.get("job-id") != config.get("job-id"):
        # Only the gate may let a round through; a ClientApp built without it must not train.
        raise RuntimeError("no ledger approval for this round")
    silo = SiloSettings.of_node(context.node_config)
    # The gate built them for this message already (dpledger/flower/built.py): the same halves and engine.
    planned = per_run.parts(context, silo.data_path, config, noise_multiplier=silo.noise_multiplier).round(config)
    if planned.mechanism_json() != approval.get("mechanism"):
        raise RuntimeError("the round would query other than what the ledger approved")
    received = family.from_record(message.content.array_records[records.ARRAYS])
    states = SiloStates(silo.state_dir, config.get("run-key"))
    stored = states.before(planned.round_index)
    state = stored if stored is not None else planned.halves.silo.start(planned.model.initial(), 1)

    # A tiny model: one thread trains it as fast as many, and leaves the site's other cores alone.
    torch.set_num_threads(1)
    started = time.perf_counter()
    planned.engine.meter.start()
    trained = planned.halves.silo.train(planned.round_index, planned.engine, torch.tensor([0]), received, state)
    planned.plan().check(torch.tensor([True]), planned.engine.meter.since_start())  # ran exactly what was approved
    train_seconds = time.perf_counter() - started
    states.save(planned.round_index, state)
    # The norm goes to the ledger through the gate with the silo's key, never into the reply.
    context.state.config_records[records.OUTCOME] = ConfigRecord({"update-norm": float(trained.norms[0])})
    return records.trained_reply(message, family.to_record(trained.upload), {"train-seconds": train_seconds})


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Test accuracy of the model this silo deploys (the global one, its cluster's, or its own)."""
    silo = SiloSettings.of_node(context.node_config)
    data = per_run.data(context, silo.data_path)
    config = _config(message)
    parts = per_run.parts(context, silo.data_path, config, noise_multiplier=silo.noise_multiplier)
    built, model = parts.halves, parts.model
    stored = SiloStates(silo.state_dir, config.get("run-key")).latest()
    state = stored if stored is not None else built.silo.start(model.initial(), 1)
    deployed = built.silo.deployed(family.from_record(message.content.array_records[records.ARRAYS]), state)[0]
    return Message(RecordDict({records.METRICS: MetricRecord({"accuracy": accuracy(model, deployed, data)})}),
                   reply_to=message)


@app.query()
def query(message: Message, context: Context) -> Message:
    """The silo's ledger id (public: the coordinator names silos by it when it creates the job)."""
    silo = SiloSettings.of_node(context.node_config)
    return Message(RecordDict({records.CONFIG: ConfigRecord({"silo-id": silo.silo_id})}), reply_to=message)
