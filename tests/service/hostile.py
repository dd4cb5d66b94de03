"""Hostile requests, generated (issue 46): mechanisms and request shapes chosen to make the server
work, for the property test (tests/service/test_hostile_search.py) and the bench
(bench/hostile_requests.py). Each draws from a `random.Random`, so Hypothesis drives it through
`st.randoms()` and the bench through a seed.

What costs dp-accounting the most (accounting/cost.py): many distinct leaves (new (q, σ) pairs,
leaves sampled without replacement, repeat_and_select over compositions), q near 1 at a small σ
(the PLD's grid), many PLD nodes, long compositions, many rounds of distinct mechanisms, σ searches.
"""

from __future__ import annotations

import random
from typing import Any

DATASET_SIZE = 10_000


def gaussian(rng: random.Random) -> dict[str, Any]:
    return {"type": "gaussian", "noise_multiplier": rng.choice([0.01, 0.3, 0.5, 1.0, 2.0, 20.0, 2000.0]) + rng.random() / 100}


def leaf(rng: random.Random, *, charged: bool) -> dict[str, Any]:
    """One leaf; `charged`: sizes as a silo's charge must give them, else raw rates (a quote)."""
    kind = rng.choice(["gaussian", "laplace", "zcdp", "dpsgd", "dpsgd", "poisson", "swr", "rs"])
    sigma = rng.choice([0.5, 0.7, 1.0, 1.1, 5.0]) + rng.random() / 1000
    rate = rng.choice([1e-4, 0.01, 0.3, 0.9, 0.999])
    if kind == "gaussian":
        return gaussian(rng)
    if kind == "laplace":
        return {"type": "laplace", "noise_multiplier": rng.choice([0.1, 1.0, 100.0]) + rng.random() / 100}
    if kind == "zcdp":
        return {"type": "zcdp", "rho": rng.random() + 1e-3}
    if kind == "dpsgd":
        sampled = {"batch_size": max(1, int(rate * DATASET_SIZE))} if charged else {"sampling_rate": rate}
        return {"type": "dpsgd", "noise_multiplier": sigma, "steps": rng.choice([1, 2, 5, 100, 10_000]), **sampled}
    if kind == "poisson":
        sampled = {"expected_batch_size": max(1, int(rate * DATASET_SIZE))} if charged else {"sampling_rate": rate}
        return {"type": "poisson_sampled", **sampled, "event": {"type": "gaussian", "noise_multiplier": sigma}}
    if kind == "swr":
        return {"type": "sampled_without_replacement", "source_size": DATASET_SIZE, "sample_size": rng.randint(1, 500),
                "event": {"type": "gaussian", "noise_multiplier": sigma}}
    inner = {"type": "composed", "events": [gaussian(rng) for _ in range(rng.choice([1, 29, 200]))]}
    return {"type": "repeat_and_select", "mean": rng.choice([2.0, 10.0, 1e4]), "shape": rng.choice([0.5, 1.0, "infinity"]),
            "event": inner}


def mechanism(rng: random.Random, *, charged: bool = False, depth: int = 0) -> dict[str, Any]:
    """A tree of leaves: wide compositions of distinct leaves, repeated units, nesting."""
    shape = rng.choice(["leaf", "composed", "composed", "repeat", "nested"] if depth < 3 else ["leaf"])
    if shape == "leaf":
        return leaf(rng, charged=charged)
    if shape == "repeat":
        return {"type": "self_composed", "count": rng.choice([2, 400, 10**6]),
                "event": mechanism(rng, charged=charged, depth=depth + 1)}
    width = rng.choice([2, 8, 16, 100, 1000])
    if shape == "nested":  # alternating units, in lists of lists
        units = [leaf(rng, charged=charged) for _ in range(2)]
        return {"type": "composed", "events": [{"type": "composed", "events": [units[k % 2] for k in range(width)]}
                                               for _ in range(rng.choice([2, 9]))]}
    return {"type": "composed", "events": [mechanism(rng, charged=charged, depth=3) for _ in range(width)]}


def request(rng: random.Random, *, silo_id: int, replace_one_silo_id: int) -> tuple[str, dict[str, Any], str]:
    """(path, body, whose key: "admin" or "silo") of one hostile request."""
    route = rng.choice(["quote", "quote_silo", "rounds", "plan", "horizon", "calibrate", "charge", "search_quote"])
    if route == "quote":
        return "/v1/quote", {"mechanism": mechanism(rng), "delta": rng.choice([1e-5, 0.5])}, "admin"
    if route == "quote_silo":
        return "/v1/quote", {"mechanism": mechanism(rng, charged=True), "silo_id": silo_id}, "silo"
    if route == "rounds":
        silo = rng.choice([silo_id, replace_one_silo_id])
        runs = [{"mechanism": mechanism(rng, charged=True, depth=2), "count": rng.choice([1, 300])}
                for _ in range(rng.choice([1, 4, 32]))]
        return "/v1/quote/rounds", {"silo_id": silo, "rounds": 1, "runs": runs, "calibrate": rng.random() < 0.2}, "admin"
    if route == "plan":
        return f"/v1/silos/{silo_id}/plan", {"mechanism": mechanism(rng, charged=True)}, "silo"
    if route == "horizon":
        body = {"name": f"h{rng.getrandbits(64)}", "epsilon": rng.choice([1e-12, 1e-3, 1.0, 1e4]),
                "delta": rng.choice([1e-5, 0.999]), "dataset_size": DATASET_SIZE}
        if rng.random() < 0.7:
            body["horizon"] = mechanism(rng, charged=True)
        return "/v1/silos", body, "admin"
    if route == "calibrate":
        return "/v1/calibrate", {"epsilon": rng.choice([1e-4, 0.1, 10.0]), "delta": 1e-5,
                                 "sampling_rate": rng.choice([1e-4, 0.5, 0.999]), "steps": rng.choice([1, 10**5, 10**7])}, "admin"
    if route == "charge":
        return (f"/v1/silos/{silo_id}/charges",
                {"mechanism": mechanism(rng, charged=True), "idempotency_key": f"k{rng.getrandbits(64)}"}, "silo")
    return "/v1/searches/quote", {"trial": mechanism(rng), "mean_trials": rng.choice([2.0, 100.0]), "delta": 1e-5,
                                  "tnb_shapes": [0.5 + i for i in range(rng.choice([1, 16]))]}, "admin"


def table(silo: int, replace_one: int) -> list[tuple[str, str, dict[str, Any], str]]:
    """The issue's table, row by row: (name, path, body, whose key)."""
    def swr(i: int) -> dict[str, Any]:
        return {"type": "sampled_without_replacement", "source_size": DATASET_SIZE, "sample_size": 10 + i,
                "event": {"type": "gaussian", "noise_multiplier": 1.0}}

    def g(sigma: float) -> dict[str, Any]:
        return {"type": "gaussian", "noise_multiplier": sigma}

    return [
        ("rounds: 32 × 4 sampled without replacement", "/v1/quote/rounds", {"silo_id": replace_one, "rounds": 32, "runs": [
            {"mechanism": {"type": "composed", "events": [swr(4 * j + i) for i in range(4)]}, "count": 1}
            for j in range(32)]}, "admin"),
        ("quote: 8 DP-SGD leaves, q ≈ 0.9, σ 0.5", "/v1/quote", {"delta": 1e-5, "mechanism": {"type": "composed", "events": [
            {"type": "dpsgd", "sampling_rate": 0.9 + i / 1000, "noise_multiplier": 0.5, "steps": 2} for i in range(8)]}},
         "admin"),
        ("quote: 9,000 alternating Gaussians", "/v1/quote", {"delta": 1e-5, "mechanism": {"type": "composed", "events": [
            {"type": "composed", "events": [g(20.0 + k % 2) for k in range(1000)]} for _ in range(9)]}}, "admin"),
        ("rounds: 32 repeat_and_select of 29 leaves", "/v1/quote/rounds", {"silo_id": silo, "rounds": 32, "runs": [
            {"mechanism": {"type": "repeat_and_select", "mean": 10, "shape": 1, "event": {"type": "composed", "events": [
                g(5 + j + i / 100) for i in range(29)]}}, "count": 1} for j in range(32)]}, "admin"),
        ("plan: 10,000 runs of alternating units", f"/v1/silos/{silo}/plan", {"mechanism": {"type": "composed", "events": [
            {"type": "composed", "events": [g(200.0 + k % 2) for k in range(1000)]} for _ in range(10)]}}, "silo"),
        ("rounds: 32 × 15 new sampled pairs", "/v1/quote/rounds", {"silo_id": silo, "rounds": 32, "runs": [
            {"mechanism": {"type": "composed", "events": [{"type": "dpsgd", "batch_size": 10 + 15 * j + i,
                                                          "noise_multiplier": 1.0, "steps": 1} for i in range(15)]},
             "count": 1} for j in range(32)]}, "admin"),
        ("quote: DP-SGD q 0.999, σ 0.5, 5 steps", "/v1/quote", {"delta": 1e-5, "mechanism": {
            "type": "dpsgd", "sampling_rate": 0.999, "noise_multiplier": 0.5, "steps": 5}}, "admin"),
        ("rounds: 32 × 1,000 distinct Gaussians", "/v1/quote/rounds", {"silo_id": silo, "rounds": 32, "runs": [
            {"mechanism": {"type": "composed", "events": [g(1 + j + i / 10_000) for i in range(1000)]}, "count": 1}
            for j in range(32)]}, "admin"),
    ]
