"""The wire contract between the ledger service and everything that talks to it: mechanisms,
request and response models, and their vocabularies, and the one typed client over them
(`client`, with its errors in `errors`). Depends on pydantic (and httpx for the client) alone, so
the worker, the silo library, a Flower app and the service's own commands import it without the
service's internals, and without torch."""
