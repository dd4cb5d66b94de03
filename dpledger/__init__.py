"""dpledger: privacy accounting for cross-silo federated learning (the service, `dpledger.service`),
the DP-SGD worker it gates (`dpledger.trainer`), the wire contract both speak (`dpledger.wire`) and the
commands that compose them."""

__version__ = "0.2.0"
