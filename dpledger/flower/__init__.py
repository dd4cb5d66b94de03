"""dpledger on Flower: each silo's SuperNode gates its own rounds on its own ledger key; the
ServerApp holds a coordinator key only and never sees a budget, an ε, or a norm.

- `settings`: what a SuperNode's `--node-config` and a run's config hold, parsed and checked.
- `records`: the few record shapes that cross the wire, and the constant statuses a silo answers.
- `gate`: the ClientApp mod (reserve before the round, commit after, report the norm at home).
- `local`: one silo's data file, a tiny CNN, and DP-SGD on the trainer's engine.
- `pmtl`: PMTL's server step and the mechanism each silo is charged for it.
- `grouped`: PFA and FedHDP by the privacy groups the ledger found after the warm-start round.
- `client_app` / `server_app`: the Flower apps (FedAvg, MR-MTL, PMTL, PFA, FedHDP).

This is composition: it imports the trainer and the wire contract, never the service.
"""
