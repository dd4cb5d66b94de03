"""The auditors' side: `dpledger verify`, `audit` and `pubkey` (`commands`), checking from outside
what the ledger signed. `transparency`: the log's heads, proofs and held receipts; `recompose`: every
silo's ε replayed from its signed entries (with the shared chain replay, `dpledger.wire.chain_replay`);
`held`: which held receipts a check reads; `witnessed`: the receipts against what witnesses cosigned.

Client side: over HTTP and the wire contract; of the service it imports only its accounting (pure
math), so that an auditor's ε is the gate's own.
"""
