"""The silo library: what runs where a silo's data lives, and nothing of the simulator.

The round gate (`gate`), the one round protocol (`rounds`), the registered-size rule (`registered`),
the DP-SGD engine (`dpsgd`) and the Opacus adapter (`opacus_gate`). A Flower ClientApp, a silo's own
loop and the in-process simulator (`dpledger.trainer.federated`, which imports this package, never
the other way) all train and open their rounds through it.
"""
