"""The wire contract between the ledger service and everything that talks to it: mechanisms,
request and response models, and their vocabularies, and the one typed client over them
(`client`, with its errors in `errors`); beside them, what the ledger and its readers must read the
same way (the log's proofs, receipts and notes; the replay of a silo's chain; how a number is shown
and a silo's text neutralised). Depends on pydantic (and httpx for the client, cryptography for
signatures) alone, so the worker, the silo library, a Flower app, the service and the commands run
against it import it without the service's internals, and without torch."""
