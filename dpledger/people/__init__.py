"""The commands a person runs against a ledger from outside it, over HTTP with an API key: `silos`,
`history` and `charges` (`commands`), and what every outside command shares (`terminal`: the
ledger from the environment, one line per failure, the exit codes). Client side: it imports the wire
contract only, never the service, so it runs wherever the ledger is reachable.
"""
