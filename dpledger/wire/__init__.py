"""The wire contract between the ledger service and everything that talks to it: mechanisms,
request and response models, and their vocabularies. Depends on pydantic alone, so the worker, the
silo library and a Flower app import it without the service, and the service without torch."""
