"""`dpledger witness`: the process an auditor or a partner site runs to cosign the ledger's checkpoints
(`cosigner`), and its commands (`commands`). Client side: over HTTP and the wire contract only.
"""
