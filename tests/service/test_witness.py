"""Witnesses with real processes: a ledger server (dpledger.harness.ServerProcess), a `dpledger witness`
that polls it, and silos running `dpledger verify --receipts --witness … --require-witnesses 1`.

Honest run: the witness cosigns the ledger's checkpoints and the silo's check names it. Then the
operator forks the log (a leaf rewritten by SQL, every node and the frontier recomputed, the server
signing the new root with the key it holds): the witness refuses to cosign, keeps serving its last
cosignature, and both the silo that held receipts from before and a silo registered after the fork
(whose own receipts all agree with the forked log) are caught by requiring the witness. The commands
of docs/guides/auditor.md's witness block run here, with its placeholders filled."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import create_engine, text

from dpledger.harness import ServerProcess, free_port
from dpledger.wire import merkle, note
from dpledger.wire.receipts import SignedTreeHead, verify_head
from tests.conftest import ADMIN_KEY, TEST_HORIZON

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.0, "steps": 1}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
TIMEOUT_S = 60


def dpledger(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "dpledger"), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)


def wait_for(condition: Any, what: str, timeout: float = TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Silo:
    """A silo that charges over HTTP and keeps each answer's receipt, as the trainer's client does."""

    def __init__(self, url: str, name: str, folder: Path) -> None:
        created = httpx.post(f"{url}/v1/silos", headers=ADMIN, json={
            "name": name, "epsilon": 10.0, "delta": 1e-5, "dataset_size": 1000, "horizon": TEST_HORIZON}).json()
        self.url, self.id, self.key, self.receipts = url, created["id"], created["api_key"], folder
        folder.mkdir()

    def charge(self, label: str) -> None:
        answer = httpx.post(f"{self.url}/v1/silos/{self.id}/charges", headers={"Authorization": f"Bearer {self.key}"},
                            json={"mechanism": STEP, "idempotency_key": label, "job_id": "j", "round": 1})
        assert answer.status_code in (200, 201), answer.text
        with (self.receipts / "receipts.jsonl").open("a") as file:
            file.write(json.dumps(answer.json()["receipt"]) + "\n")


def log_state(url: str) -> tuple[int, str]:
    body = httpx.get(f"{url}/v1/log/head", headers=ADMIN).json()
    return body["tree_size"], body["root_hash"]


def fork(database_url: str, index: int) -> None:
    """The operator's rewrite: leaf `index` replaced, every stored subtree and the frontier recomputed
    from the leaves, so that the log the server signs from now on is whole but another one."""
    engine = create_engine(database_url)
    with engine.begin() as connection:
        leaves = [bytes.fromhex(h) for (h,) in connection.execute(text("SELECT leaf_hash FROM log_leaves ORDER BY idx"))]
        leaves[index] = merkle.leaf_hash(b"what the operator would rather have written")
        connection.execute(text("UPDATE log_leaves SET leaf_hash = :h WHERE idx = :i"), {"h": leaves[index].hex(), "i": index})
        connection.execute(text("DELETE FROM log_nodes"))
        frontier: list[bytes] = []
        for i, leaf in enumerate(leaves):
            frontier, completed, _ = merkle.append(frontier, i, leaf)
            for start, width, digest in completed:
                connection.execute(text("INSERT INTO log_nodes (level, idx, hash) VALUES (:l, :i, :h)"),
                                   {"l": width.bit_length() - 1, "i": start // width, "h": digest.hex()})
        connection.execute(text("UPDATE log_state SET frontier = :f"), {"f": json.dumps([h.hex() for h in frontier])})
    engine.dispose()
    assert merkle.frontier_root(frontier) == merkle.root(leaves)


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str, Path]]:
    key = tmp_path / "log.pem"
    key.write_bytes(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    monkeypatch.setenv("DPLEDGER_SIGNING_KEY_FILE", str(key))
    monkeypatch.setenv("DPLEDGER_LOG_ORIGIN", "ledger.example/consortium-log")
    database_url = f"sqlite:///{tmp_path}/ledger.db"
    with ServerProcess(database_url=database_url, admin_key=ADMIN_KEY) as server:
        yield server.url, database_url, key


def guide_blocks() -> list[str]:
    """The shell blocks of docs/guides/auditor.md's witness section: the witness's, then the silo's."""
    section = (ROOT / "docs" / "guides" / "auditor.md").read_text().split("## Witnesses\n", 1)[1].split("\n## ", 1)[0]
    return [part.split("```", 1)[0] for part in section.split("```\n")[1::2]]


def test_the_witness_cosigns_an_honest_log_refuses_a_fork_and_a_silo_requiring_it_finds_the_fork(
    ledger: tuple[str, str, Path], tmp_path: Path
) -> None:
    url, database_url, key_file = ledger
    a = Silo(url, "hospital-a", tmp_path / "receipts-a")
    for label in ("a0", "a1", "a2"):
        a.charge(label)
    auditor = httpx.post(f"{url}/v1/keys", headers=ADMIN, json={"role": "auditor"}).json()["api_key"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPLEDGER_")}
    env.update(DPLEDGER_URL=url, DPLEDGER_KEY=auditor, PATH=f"{BIN}:{os.environ['PATH']}")
    port = free_port()

    # The guide's block: the witness's key, the log's key it pins, the witness itself.
    witness_block, silo_block = guide_blocks()
    env["WITNESS_PORT"] = str(port)  # as a reader whose 7380 is taken sets it: the blocks name no port of their own
    assert "--port $WITNESS_PORT" in witness_block and "127.0.0.1:${WITNESS_PORT:-7380}/" in silo_block
    script = witness_block.replace("witness.example.org/w1", "witness.test/w1")
    script = script.replace("--interval 10", "--interval 0.2")
    workdir = tmp_path / "witness"
    workdir.mkdir()
    started = subprocess.Popen(["bash", "-c", f"set -e\n{script}\necho $! > witness.pid\nwait"], cwd=workdir, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        witness_url = f"http://127.0.0.1:{port}/checkpoint"
        wait_for(lambda: (workdir / "witness.pid").exists() or started.poll() is not None, "the block's three lines")
        assert started.poll() is None, started.communicate()[0]
        wvkey = (workdir / "witness.vkey").read_text().strip()
        log_vkey = note.VerifierKey.parse((workdir / "log.vkey").read_text().strip())
        public = key_file.read_bytes()
        assert log_vkey.name == "ledger.example/consortium-log"
        assert log_vkey.public_key == serialization.load_pem_private_key(public, None).public_key().public_bytes(  # type: ignore[union-attr]  # an Ed25519 key
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        witness_key = note.VerifierKey.parse(wvkey)

        def cosigned_size(at_least: int) -> note.SignedCheckpoint | None:
            try:
                answer = httpx.get(witness_url, timeout=2)
            except httpx.TransportError:
                return None
            if answer.status_code != 200:
                return None
            seen = note.open_checkpoint(answer.text, log_vkey, also=[witness_key])
            return seen if seen.checkpoint.size >= at_least and seen.opened.by(witness_key) else None

        size = wait_for(lambda: log_state(url)[0] >= 4 and log_state(url)[0], "the sequencer")  # a's create, 3 reserves
        honest = wait_for(lambda: cosigned_size(size), "the witness's first cosignature")
        # What the witness vouches for is the ledger's own head at that size.
        head = SignedTreeHead(**httpx.get(f"{url}/v1/log/head", params={"size": honest.checkpoint.size}, headers=ADMIN).json())
        verify_head(head, log_vkey.public_key)
        assert head.root_hash == honest.checkpoint.root_hash.hex()

        silo_env = {**env, "DPLEDGER_KEY": a.key, "PATH": f"{BIN}:{env['PATH']}"}
        witness_arg = f"{witness_url}={wvkey}"
        silo_line = silo_block.replace("--receipts ", f"--receipts {a.receipts} ")
        ok = subprocess.run(["bash", "-c", silo_line], cwd=workdir, env=silo_env, capture_output=True, text=True,
                            timeout=TIMEOUT_S)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        named = re.search(rf"ok: witness witness\.test/w1\+{witness_key.key_id:08x} cosigned size (\d+) root ([0-9a-f]{{64}}) "
                          r"at time (\d+) \(.* UTC\): the ledger's log of size (\d+) extends it", ok.stdout)
        assert named is not None, ok.stdout
        assert int(named.group(4)) >= int(named.group(1)) >= size
        assert int(named.group(3)) == pytest.approx(time.time(), abs=120)

        # The operator forks the log under the entries of silo a, and the server signs the new root.
        last_good = wait_for(lambda: cosigned_size(log_state(url)[0]), "the witness to catch up")
        fork(database_url, index=3)
        assert log_state(url)[1] != last_good.checkpoint.root_hash.hex()
        state = workdir / "witness-state.json"
        refusal = wait_for(lambda: state.exists() and json.loads(state.read_text())["refusals"], "the witness's refusal")[0]
        assert refusal["refused"].startswith(f"FORK: two checkpoints of size {last_good.checkpoint.size} signed by the log's key")
        assert note.open_checkpoint(refusal["served"], log_vkey).checkpoint.root_hash.hex() == log_state(url)[1]
        time.sleep(1.0)  # several more polls: it keeps refusing and keeps serving its last good cosignature
        assert httpx.get(witness_url).text == last_good.text
        assert (workdir / "cosigned.txt").read_text() == last_good.text

        # Silo b registers after the fork: every receipt it holds agrees with the forked log, so its own
        # check passes; requiring the witness shows it a log the witness never saw grow from its own.
        b = Silo(url, "clinic-b", tmp_path / "receipts-b")
        b.charge("b0")
        wait_for(lambda: log_state(url)[0] >= last_good.checkpoint.size + 2, "silo b's entries in the log")
        b_env = {**env, "DPLEDGER_KEY": b.key}
        alone = dpledger("verify", "--receipts", str(b.receipts), env=b_env, cwd=tmp_path)
        assert alone.returncode == 0, alone.stdout + alone.stderr
        for silo, silo_env_ in ((b, b_env), (a, silo_env)):
            caught = dpledger("verify", "--receipts", str(silo.receipts), "--witness", witness_arg, "--require-witnesses", "1",
                              env=silo_env_, cwd=tmp_path)
            assert caught.returncode == 1, caught.stdout + caught.stderr
            assert f"FORK: witness witness.test/w1+{witness_key.key_id:08x} cosigned size {last_good.checkpoint.size}" \
                   in caught.stdout
            assert "0 of the 1 witnesses required vouch for a log consistent with the receipts (none)" in caught.stdout
            proof = json.loads(caught.stdout.split("today):\n", 1)[1].split("\n}\n", 1)[0] + "\n}")
            # The proof stands alone: the log's key signed both, for one size, with two roots.
            witnessed = note.open_checkpoint(proof["witnessed_checkpoint"], log_vkey, also=[witness_key])
            ledger_head = SignedTreeHead(**proof["ledger_head"])
            verify_head(ledger_head, log_vkey.public_key)
            assert ledger_head.tree_size == witnessed.checkpoint.size
            assert ledger_head.root_hash != witnessed.checkpoint.root_hash.hex()
    finally:
        os.killpg(started.pid, signal.SIGTERM)
        started.communicate(timeout=TIMEOUT_S)
    logged = (workdir / "witness.log").read_text()
    assert "refused to cosign" in logged and last_good.text.split("\n\n")[0] in logged.replace("\\n", "\n")


def test_a_witness_refuses_a_checkpoint_not_signed_by_the_key_it_pinned(ledger: tuple[str, str, Path], tmp_path: Path) -> None:
    url, _, _ = ledger
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPLEDGER_")}
    env.update(DPLEDGER_URL=url, DPLEDGER_KEY=ADMIN_KEY)
    created = dpledger("witness", "keys", "create", "--name", "witness.test/w2", "--out", "w2.key", env=env, cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    assert oct((tmp_path / "w2.key").stat().st_mode & 0o777) == "0o600"
    impostor = note.Signer.generate("ledger.example/consortium-log").verifier.encode()  # the right origin, another key
    once = dpledger("witness", "--log-key", impostor, "--key", "w2.key", "--state", "s.json", "--once", env=env, cwd=tmp_path)
    assert once.returncode == 1, once.stdout + once.stderr
    assert "REFUSED: the served checkpoint does not verify under the pinned log key" in once.stdout
    served = httpx.get(f"{url}/v1/log/checkpoint", headers=ADMIN)
    assert served.headers["content-type"] == "text/plain; charset=utf-8"
    coordinator = httpx.post(f"{url}/v1/keys", headers=ADMIN, json={"role": "coordinator"}).json()["api_key"]
    assert httpx.get(f"{url}/v1/log/checkpoint", headers={"Authorization": f"Bearer {coordinator}"}).status_code == 403
