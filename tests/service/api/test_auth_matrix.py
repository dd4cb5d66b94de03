"""Every route × every role → the answer the role table of docs/ARCHITECTURE.md and the issue's contract give."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
from sqlalchemy import text

from tests.conftest import ADMIN, bearer

STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.0, "steps": 1}
ROLES = ["admin", "own_silo", "other_silo", "auditor", "coordinator", "no_key", "unknown_key", "revoked_key"]


@dataclass
class World:
    client: object
    silo_id: int
    job_id: int
    keys: dict[str, dict[str, str]]
    counter: int = 0

    def reserved_charge(self) -> int:
        self.counter += 1
        response = self.client.post(  # type: ignore[attr-defined]
            f"/v1/silos/{self.silo_id}/charges",
            json={"mechanism": STEP, "idempotency_key": f"setup-{self.counter}"},
            headers=self.keys["own_silo"],
        )
        assert response.status_code == 201, response.text
        return int(response.json()["charge_id"])

    def search(self) -> int:
        """A running search of the own silo; Poisson-free (geometric K ≥ 1), so a trial can be reported."""
        self.counter += 1
        response = self.client.post(  # type: ignore[attr-defined]
            f"/v1/silos/{self.silo_id}/searches",
            json={
                "trial": STEP,
                "mean_trials": 1,
                "distribution": {"kind": "geometric"},
                "idempotency_key": f"setup-s-{self.counter}",
            },
            headers=self.keys["own_silo"],
        )
        assert response.status_code == 201, response.text
        return int(response.json()["search_id"])

    def fresh_silo(self) -> tuple[int, dict[str, str]]:
        """A new silo and its key, for a route that changes a silo for good (a plan, a seal, a
        retirement): the world's own silo must stay as it is for the other roles' calls. Registered
        with a horizon, so its filter is fixed (a silo whose first charge is still to fix it cannot be sealed)."""
        self.counter += 1
        body = {"name": f"fresh-{self.counter}", "epsilon": 1000.0, "delta": 1e-5, "dataset_size": 1000, "horizon": STEP}
        response = self.client.post("/v1/silos", json=body, headers=ADMIN)  # type: ignore[attr-defined]
        assert response.status_code == 201, response.text
        return int(response.json()["id"]), bearer(response.json()["api_key"])

    def tampered_silo(self) -> int:
        """A fresh silo whose row was edited in the database, the only kind an admin may seal
        (an intact one answers 409, nothing to seal)."""
        silo_id, _ = self.fresh_silo()
        with self.client.app.state.engine.begin() as connection:  # type: ignore[attr-defined]
            connection.execute(text("UPDATE silos SET epsilon = epsilon * 2 WHERE id = :id"), {"id": silo_id})
        return silo_id

    def own_leaf(self) -> tuple[int, str]:
        """(log index, leaf hash) of the own silo's create entry, once the sequencer (0.1–1 s after)
        has given it an index: a pending leaf answers 404 to a proof by hash."""
        deadline = time.monotonic() + 10
        while True:
            leaves = self.client.get(f"/v1/log/leaves?silo_id={self.silo_id}", headers=ADMIN).json()  # type: ignore[attr-defined]
            if leaves:
                return int(leaves[0]["log_index"]), str(leaves[0]["leaf_hash"])
            assert time.monotonic() < deadline, "the own silo's create entry was never sequenced"
            time.sleep(0.05)


@pytest.fixture
def world(client, make_silo) -> World:  # type: ignore[no-untyped-def]
    own = make_silo(epsilon=1000.0)
    other = make_silo(epsilon=1000.0)

    def key(role: str) -> dict[str, str]:
        response = client.post("/v1/keys", json={"role": role}, headers=ADMIN)
        assert response.status_code == 201, response.text
        return bearer(response.json()["api_key"])

    revoked = client.post("/v1/keys", json={"role": "admin"}, headers=ADMIN).json()
    assert client.delete(f"/v1/keys/{revoked['key_id']}", headers=ADMIN).status_code == 204
    keys = {
        "admin": ADMIN, "own_silo": own.headers, "other_silo": other.headers, "auditor": key("auditor"),
        "coordinator": key("coordinator"), "no_key": {}, "unknown_key": bearer("dpl_not-a-key"),
        "revoked_key": bearer(revoked["api_key"]),
    }
    job = client.post("/v1/jobs", json={"name": "matrix", "silo_ids": [own.id, other.id]}, headers=ADMIN).json()
    return World(client, own.id, job["job_id"], keys)


def request_for(route: str, world: World) -> tuple[str, str, dict | None]:
    s = world.silo_id
    match route:
        case "create_silo":
            world.counter += 1
            return "POST", "/v1/silos", {"name": f"new-{world.counter}", "epsilon": 1, "delta": 1e-5, "dataset_size": 9}
        case "list_silos":
            return "GET", "/v1/silos", None
        case "get_silo":
            return "GET", f"/v1/silos/{s}", None
        case "reserve_charge":
            world.counter += 1
            return "POST", f"/v1/silos/{s}/charges", {"mechanism": STEP, "idempotency_key": f"m-{world.counter}"}
        case "commit_charge":
            return "POST", f"/v1/charges/{world.reserved_charge()}/commit", None
        case "release_charge":
            return "POST", f"/v1/charges/{world.reserved_charge()}/release", None
        case "get_charge":
            return "GET", f"/v1/charges/{world.reserved_charge()}", None
        case "list_charges":
            return "GET", f"/v1/silos/{s}/charges?status=reserved", None
        case "silo_history":
            return "GET", f"/v1/silos/{s}/history", None
        case "silo_history_csv":
            return "GET", f"/v1/silos/{s}/history?format=csv", None
        case "verify_ledger":
            return "GET", "/v1/audit/verify", None
        case "quote":
            return "POST", "/v1/quote", {"mechanism": {"type": "gaussian", "noise_multiplier": 2.0}, "delta": 1e-5}
        case "quote_for_silo":
            return "POST", "/v1/quote", {"mechanism": STEP, "silo_id": s}
        case "calibrate":
            return "POST", "/v1/calibrate", {"epsilon": 3.0, "delta": 1e-5, "sampling_rate": 0.05, "steps": 20}
        case "create_key":
            return "POST", "/v1/keys", {"role": "auditor"}
        case "revoke_key":
            created = world.client.post("/v1/keys", json={"role": "auditor"}, headers=ADMIN).json()  # type: ignore[attr-defined]
            return "DELETE", f"/v1/keys/{created['key_id']}", None
        case "create_job":
            return "POST", "/v1/jobs", {"name": "j", "silo_ids": [s]}
        case "report_norm":
            world.counter += 1
            return "POST", f"/v1/jobs/{world.job_id}/rounds/{world.counter}/norms", {"silo_id": s, "l2_norm": 1.5}
        case "round_groups":
            return "GET", f"/v1/jobs/{world.job_id}/rounds/0/groups", None
        case "publish_level":
            world.counter += 1
            return "POST", "/v1/levels", {"name": f"level-{world.counter}", "epsilon": 1.0, "delta": 1e-5}
        case "list_levels":
            return "GET", "/v1/levels", None
        case "healthz":
            return "GET", "/healthz", None
        case "start_search":
            world.counter += 1
            return "POST", f"/v1/silos/{s}/searches", {
                "trial": STEP, "mean_trials": 3, "distribution": {"kind": "geometric"}, "idempotency_key": f"s-{world.counter}",
            }
        case "get_search":
            return "GET", f"/v1/searches/{world.search()}", None
        case "report_trial":
            return "POST", f"/v1/searches/{world.search()}/trials", {"score": 0.5}
        case "quote_search":
            return (
                "POST",
                "/v1/searches/quote",
                {"trial": {"type": "gaussian", "noise_multiplier": 2.0}, "mean_trials": 3, "delta": 1e-5},
            )
        case "log_public_key":
            return "GET", "/v1/log/public-key", None
        case "log_head":
            return "GET", "/v1/log/head", None
        case "log_inclusion_proof":  # log index 0 is the own silo's create entry (it was registered first)
            return "GET", f"/v1/log/proofs/inclusion?index={world.own_leaf()[0]}", None
        case "log_inclusion_by_hash":
            return "GET", f"/v1/log/proofs/by-hash?leaf_hash={world.own_leaf()[1]}", None
        case "log_proofs":  # an inclusion proof of the own silo's entry, and a consistency proof
            return "GET", f"/v1/log/proofs?inclusion={world.own_leaf()[0]}&consistency=1", None
        case "log_checkpoint":
            return "GET", "/v1/log/checkpoint", None
        case "who_am_i":
            return "GET", "/v1/keys/me", None
        case "calibrate_silo":
            return "POST", f"/v1/silos/{s}/calibrate", {"batch_size": 10, "steps_per_round": 1, "rounds": 5}
        case "quote_rounds":
            return "POST", "/v1/quote/rounds", {"silo_id": s, "rounds": 2, "runs": [{"mechanism": STEP, "count": 2}]}
        case "quote_rounds_calibrate":
            return "POST", "/v1/quote/rounds", {
                "silo_id": s, "rounds": 2, "runs": [{"mechanism": STEP, "count": 2}], "calibrate": True,
            }
        case "declare_plan":
            # A plan is declared once, before a silo's first charge: each call plans a fresh silo,
            # whose key is the own silo's key for this call (the other silo's key stays another's).
            fresh, world.keys["own_silo"] = world.fresh_silo()
            return "POST", f"/v1/silos/{fresh}/plan", {"mechanism": {**STEP, "steps": 10}}
        case "seal_silo":
            return "POST", f"/v1/silos/{world.tampered_silo()}/seal", None
        case "retire_silo":  # once per silo, and never the world's own (later calls need it approving)
            return "POST", f"/v1/silos/{world.fresh_silo()[0]}/retire", {"reason": "registered with the wrong dataset size"}
        case "log_consistency_proof":  # from the tree of the own silo's create entry alone (sequenced first)
            return "GET", f"/v1/log/proofs/consistency?first={world.own_leaf()[0] + 1}", None
        case "log_leaves":
            return "GET", "/v1/log/leaves", None
        case "log_record_verified_head":
            return "POST", "/v1/log/verified", world.client.get("/v1/log/head", headers=ADMIN).json()  # type: ignore[attr-defined]
    raise AssertionError(route)


# Expected status per role, in ROLES order. 401 for any request without a valid key.
A = [401, 401, 401]
EXPECTED = {
    "create_silo":      [201, 403, 403, 403, 403, *A],
    "list_silos":       [200, 403, 403, 200, 403, *A],
    "get_silo":         [200, 200, 404, 200, 404, *A],
    "reserve_charge":   [403, 201, 404, 403, 404, *A],
    "get_charge":       [200, 200, 404, 200, 404, *A],
    "list_charges":     [200, 200, 404, 200, 404, *A],
    "commit_charge":    [200, 200, 404, 403, 403, *A],
    "release_charge":   [200, 200, 404, 403, 403, *A],
    "silo_history":     [200, 200, 404, 200, 404, *A],
    "silo_history_csv": [200, 200, 404, 200, 404, *A],
    "verify_ledger":    [200, 403, 403, 200, 403, *A],
    "quote":            [200, 200, 200, 200, 200, *A],
    "quote_for_silo":   [200, 200, 404, 200, 404, *A],
    "calibrate":        [200, 200, 200, 200, 200, *A],
    "create_key":       [201, 403, 403, 403, 403, *A],
    "revoke_key":       [204, 403, 403, 403, 403, *A],
    "create_job":       [201, 403, 403, 403, 201, *A],
    "report_norm":      [403, 201, 404, 403, 404, *A],
    "round_groups":     [200, 403, 403, 200, 200, *A],
    "publish_level":    [201, 403, 403, 403, 403, *A],
    "list_levels":      [200, 200, 200, 200, 200, *A],
    "healthz":          [200, 200, 200, 200, 200, 200, 200, 200],
    "start_search":     [403, 201, 404, 403, 404, *A],
    "get_search":       [200, 200, 404, 200, 404, *A],
    "report_trial":     [403, 200, 404, 403, 403, *A],
    "quote_search":     [200, 200, 200, 200, 200, *A],
    # The transparency log: hashes for every silo, records and proofs of its own entries; the
    # coordinator only the public key (the log's size counts approvals, which depend on budgets).
    "log_public_key":   [200, 200, 200, 200, 200, *A],
    "log_head":         [200, 200, 200, 200, 403, *A],
    "log_inclusion_proof": [200, 200, 403, 200, 403, *A],
    "log_consistency_proof": [200, 200, 200, 200, 403, *A],
    "log_leaves":       [200, 200, 200, 200, 403, *A],
    "log_record_verified_head": [201, 403, 403, 201, 403, *A],
    "log_inclusion_by_hash": [200, 200, 403, 200, 403, *A],
    "log_proofs":       [200, 200, 403, 200, 403, *A],
    "log_checkpoint":   [200, 200, 200, 200, 403, *A],
    "who_am_i":         [200, 200, 200, 200, 200, *A],
    # A σ for the silo's rounds, a plan, rounds priced with calibrate: functions of its budget, for
    # its own key and admins only (an auditor may read a silo, not plan its spending).
    "calibrate_silo":   [200, 200, 404, 403, 404, *A],
    "declare_plan":     [201, 201, 404, 403, 404, *A],
    "quote_rounds":     [200, 200, 404, 200, 404, *A],
    "quote_rounds_calibrate": [200, 200, 404, 403, 404, *A],
    # Admin only, whatever the silo: a role refused before the id is read learns nothing of it.
    "seal_silo":        [200, 403, 403, 403, 403, *A],
    "retire_silo":      [200, 403, 403, 403, 403, *A],
}
# Matrix rows that are another request to one operation of the app (a query parameter, a body
# field), not an operation of their own: each names the operation it varies.
VARIANTS = {"silo_history_csv": "silo_history", "quote_for_silo": "quote", "quote_rounds_calibrate": "quote_rounds"}


@pytest.mark.parametrize("route", sorted(EXPECTED))
def test_every_role_gets_the_answer_of_the_role_table(world: World, route: str) -> None:
    answers = {}
    for role in ROLES:
        method, path, body = request_for(route, world)
        response = world.client.request(method, path, json=body, headers=world.keys[role])  # type: ignore[attr-defined]
        answers[role] = response.status_code
    assert answers == dict(zip(ROLES, EXPECTED[route], strict=True))


def test_every_route_of_the_app_is_in_the_matrix(app) -> None:  # type: ignore[no-untyped-def]
    """Read from the OpenAPI document, whose operation ids are the route names (app._operation_id):
    `app.routes` holds each included router as one wrapper, not its routes, and saw only /healthz."""
    paths = app.openapi()["paths"]
    operations = {operation["operationId"] for methods in paths.values() for operation in methods.values()}
    assert set(EXPECTED) - set(VARIANTS) == operations
    assert set(VARIANTS.values()) <= operations


def test_a_refused_coordinator_learns_nothing_of_a_budget(world: World) -> None:
    response = world.client.get(f"/v1/silos/{world.silo_id}", headers=world.keys["coordinator"])  # type: ignore[attr-defined]
    assert response.status_code == 404
    assert response.json() == {"detail": f"silo {world.silo_id} not found"}


def test_an_id_the_caller_may_not_see_answers_exactly_like_one_that_does_not_exist(world: World) -> None:
    """Issue 13, item 8: a 403 for an existing id beside a 404 for a missing one let the coordinator
    count approvals and searches. Every id route answers both the same, byte for byte."""
    client, missing = world.client, 10**6
    charge, search = world.reserved_charge(), world.search()
    pairs = [
        ("GET", f"/v1/silos/{world.silo_id}", f"/v1/silos/{missing}", None),
        ("GET", f"/v1/charges/{charge}", f"/v1/charges/{missing}", None),
        ("GET", f"/v1/searches/{search}", f"/v1/searches/{missing}", None),
        ("GET", f"/v1/silos/{world.silo_id}/history", f"/v1/silos/{missing}/history", None),
        ("POST", f"/v1/charges/{charge}/commit", f"/v1/charges/{missing}/commit", None),
        ("POST", f"/v1/charges/{charge}/release", f"/v1/charges/{missing}/release", None),
    ]
    for role in ("coordinator", "other_silo"):
        for method, seen, unseen, body in pairs:
            a = client.request(method, seen, json=body, headers=world.keys[role])  # type: ignore[attr-defined]
            b = client.request(method, unseen, json=body, headers=world.keys[role])  # type: ignore[attr-defined]
            if role == "other_silo" or method == "GET":
                assert a.status_code == b.status_code == 404, (role, seen, a.text)
                assert a.json()["detail"].replace(seen.split("/")[3], "N") == b.json()["detail"].replace(str(missing), "N")
            else:  # a coordinator may not settle any charge: refused by its role, whatever the id
                assert a.status_code == b.status_code == 403 and a.json() == b.json()

    def budget_requests(silo_id: int) -> list[tuple[str, dict[str, object]]]:
        """What answers from a silo's budget (a σ, a plan, rounds priced), for the silo `silo_id`."""
        runs = [{"mechanism": STEP, "count": 1}]
        return [
            (f"/v1/silos/{silo_id}/calibrate", {"batch_size": 10, "steps_per_round": 1, "rounds": 2}),
            (f"/v1/silos/{silo_id}/plan", {"mechanism": STEP}),
            ("/v1/quote/rounds", {"silo_id": silo_id, "rounds": 1, "runs": runs}),
            ("/v1/quote/rounds", {"silo_id": silo_id, "rounds": 1, "runs": runs, "calibrate": True}),
        ]

    budget_pairs = list(zip(budget_requests(world.silo_id), budget_requests(missing), strict=True))
    for role in ("coordinator", "other_silo"):
        for (seen, seen_body), (unseen, unseen_body) in budget_pairs:
            a = client.post(seen, json=seen_body, headers=world.keys[role])  # type: ignore[attr-defined]
            b = client.post(unseen, json=unseen_body, headers=world.keys[role])  # type: ignore[attr-defined]
            assert a.status_code == b.status_code == 404, (role, seen, a.text)
            assert a.json()["detail"].replace(str(world.silo_id), "N") == b.json()["detail"].replace(str(missing), "N")
    # A job of silos the coordinator names: the error says no more than "not all exist".
    body = {"name": "j", "silo_ids": [world.silo_id, missing]}
    response = client.post("/v1/jobs", json=body, headers=world.keys["coordinator"])  # type: ignore[attr-defined]
    assert response.status_code == 422 and str(world.silo_id) not in response.text and str(missing) not in response.text


def test_keys_me_names_the_callers_role_and_silo_and_a_foreign_silo_says_whose_key_it_is(client) -> None:  # type: ignore[no-untyped-def]
    body = {"name": "me-a", "epsilon": 1.0, "delta": 1e-5, "dataset_size": 10}
    silo = client.post("/v1/silos", json=body, headers=ADMIN).json()
    own = {"Authorization": f"Bearer {silo['api_key']}"}
    me = client.get("/v1/keys/me", headers=own).json()
    assert (me["role"], me["silo_id"]) == ("silo", silo["id"]) and me["key_id"] >= 1
    assert client.get("/v1/keys/me", headers=ADMIN).json()["silo_id"] is None
    assert client.get("/v1/keys/me").status_code == 401
    other = client.get(f"/v1/silos/{silo['id'] + 1}", headers=own)  # another silo's id is not this key's to see
    assert other.status_code == 404 and other.json() == {"detail": f"silo {silo['id'] + 1} not found"}
