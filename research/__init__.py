"""Research code: paper-theory closed forms, their Monte Carlo simulators, and the synthetic data
sets and aggregation rules only they use. The benches (bench/) and tests (tests/research/) import
it from the repository root; no product module does, and it is not part of the installed package,
so it can follow the papers' notation freely without becoming something the worker runs."""
