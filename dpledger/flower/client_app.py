"""The silo's ClientApp: DP-SGD on the silo's own data, run only under the approval that
`gate.ledger_gate` wrote into the silo's state for this very round.

FedAvg, PFA, FedHDP: start from the global model, send the trained model back. MR-MTL: the personal model stays
in the silo's state; it trains towards the server's mean and sends its personal model, which the
server averages into the next mean (already-private outputs: post-processing)."""

from __future__ import annotations

import math
import time

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from dpledger.flower import records
from dpledger.flower.gate import ledger_gate
from dpledger.flower.local import accuracy, dp_sgd, load_silo_file, template
from dpledger.flower.settings import ALGORITHMS, SiloSettings

app = ClientApp(mods=[ledger_gate])


def _config(message: Message) -> ConfigRecord:
    return message.content.config_records[records.CONFIG]


def _number(config: ConfigRecord, key: str) -> float:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"train config {key!r} must be a finite number. Found {value!r}.")
    return float(value)


@app.train()
def train(message: Message, context: Context) -> Message:
    approval = context.state.config_records.get(records.APPROVAL)
    config = _config(message)
    if approval is None or approval.get("round") != config.get("round") or approval.get("job-id") != config.get("job-id"):
        # Only the gate may let a round through; a ClientApp built without it must not train.
        raise RuntimeError("no ledger approval for this round")
    silo = SiloSettings.of_node(context.node_config)
    data = load_silo_file(silo.data_path)
    algorithm = config.get("algorithm")
    model = template(seed=int(_number(config, "seed")))
    received = records.from_record(message.content.array_records[records.ARRAYS])
    if received.shape != (model.size,):
        raise ValueError(f"the server's model has {received.shape[0]} parameters, this model {model.size}")
    anchor: torch.Tensor | None = None
    if algorithm in ("mrmtl", "pmtl"):
        personal = context.state.array_records.get(records.PERSONAL)
        start = records.from_record(personal) if personal is not None else received
        anchor = received  # the server's mean of the personal models
    elif algorithm in ("fedavg", "pfa", "fedhdp"):
        start = received  # the global model; PFA and FedHDP differ from FedAvg only at the server
    else:
        raise ValueError(f"train config 'algorithm' must be one of {list(ALGORITHMS)}. Found {algorithm!r}.")

    # A tiny model: one thread trains it as fast as many, and leaves the site's other cores alone.
    torch.set_num_threads(1)
    started = time.perf_counter()
    steps, batch_size, sigma = approval["steps"], approval["batch-size"], approval["noise-multiplier"]
    assert isinstance(steps, int) and isinstance(batch_size, int) and isinstance(sigma, float)  # written by the gate
    trained = dp_sgd(model, data, start, steps=steps, batch_size=batch_size, noise_multiplier=sigma,
                     clip_norm=_number(config, "clip-norm"), lr=_number(config, "lr"), anchor=anchor,
                     lam=_number(config, "lam") if anchor is not None else 0.0)
    train_seconds = time.perf_counter() - started
    if algorithm in ("mrmtl", "pmtl"):
        context.state.array_records[records.PERSONAL] = records.to_record(trained)
    # The norm goes to the ledger through the gate with the silo's key, never into the reply.
    context.state.config_records[records.OUTCOME] = ConfigRecord(
        {"update-norm": float(torch.linalg.vector_norm(trained - start))}
    )
    return records.trained_reply(message, trained, {"train-seconds": train_seconds})


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Test accuracy of the model this silo deploys (the global one, or its personal one)."""
    silo = SiloSettings.of_node(context.node_config)
    data = load_silo_file(silo.data_path)
    config = _config(message)
    model = template(seed=int(_number(config, "seed")))
    personal = context.state.array_records.get(records.PERSONAL)
    if config.get("algorithm") in ("mrmtl", "pmtl") and personal is not None:
        params = records.from_record(personal)
    else:
        params = records.from_record(message.content.array_records[records.ARRAYS])
    return Message(RecordDict({records.METRICS: MetricRecord({"accuracy": accuracy(model, params, data)})}),
                   reply_to=message)


@app.query()
def query(message: Message, context: Context) -> Message:
    """The silo's ledger id (public: the coordinator names silos by it when it creates the job)."""
    silo = SiloSettings.of_node(context.node_config)
    return Message(RecordDict({records.CONFIG: ConfigRecord({"silo-id": silo.silo_id})}), reply_to=message)
