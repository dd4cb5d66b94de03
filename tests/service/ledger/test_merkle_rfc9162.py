"""dpledger.wire.merkle against RFC 9162 §2.1: the published Certificate Transparency test vectors
(the eight leaves and the roots, inclusion and consistency proofs that every CT implementation
pins), the RFC's recursive definitions written out naively over lists, and tampered proofs."""

from __future__ import annotations

import hashlib
import random

import pytest

from dpledger.wire import merkle

LEAF_DATA = [bytes.fromhex(h) for h in
             ("", "00", "10", "2021", "3031", "40414243", "5051525354555657", "606162636465666768696a6b6c6d6e6f")]
ROOTS = [
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]
# (0-based leaf index, tree size, path)
INCLUSION = [
    (0, 8, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (5, 8, ["bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
    (2, 3, ["fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"]),
    (1, 5, ["6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"]),
]
CONSISTENCY = [
    (1, 1, []),
    (1, 8, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (6, 8, ["0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
    (2, 5, ["5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"]),
]
LEAVES = [merkle.leaf_hash(d) for d in LEAF_DATA]


# --- the RFC's definitions, written out over lists (O(n) and obviously the text) ----------------
def mth(d: list[bytes]) -> bytes:
    if not d:
        return hashlib.sha256(b"").digest()
    if len(d) == 1:
        return d[0]
    k = merkle.split(len(d))
    return merkle.node_hash(mth(d[:k]), mth(d[k:]))


def path(m: int, d: list[bytes]) -> list[bytes]:
    if len(d) == 1:
        return []
    k = merkle.split(len(d))
    return [*path(m, d[:k]), mth(d[k:])] if m < k else [*path(m - k, d[k:]), mth(d[:k])]


def subproof(m: int, d: list[bytes], b: bool) -> list[bytes]:
    if m == len(d):
        return [] if b else [mth(d)]
    k = merkle.split(len(d))
    return [*subproof(m, d[:k], b), mth(d[k:])] if m <= k else [*subproof(m - k, d[k:], False), mth(d[:k])]


def over(leaves: list[bytes]) -> merkle.Subtree:
    return lambda start, width: mth(leaves[start:start + width])


def test_published_roots_for_every_size_and_the_compact_range_agrees() -> None:
    assert merkle.root([]).hex() == ROOTS[0] == merkle.frontier_root([]).hex()
    frontier: list[bytes] = []
    for n in range(1, 9):
        assert merkle.root(LEAVES[:n]).hex() == ROOTS[n]
        frontier, _, _ = merkle.append(frontier, n - 1, LEAVES[n - 1])
        assert merkle.frontier_root(frontier).hex() == ROOTS[n]
        assert len(frontier) == len(merkle.frontier_widths(n)) == bin(n).count("1")


@pytest.mark.parametrize(("index", "size", "expected"), INCLUSION)
def test_published_inclusion_proofs(index: int, size: int, expected: list[str]) -> None:
    proof = merkle.inclusion_proof(index, size, over(LEAVES[:size]))
    assert [p.hex() for p in proof] == expected
    merkle.verify_inclusion(index=index, size=size, leaf=LEAVES[index], path=proof, root_hash=bytes.fromhex(ROOTS[size]))


@pytest.mark.parametrize(("first", "second", "expected"), CONSISTENCY)
def test_published_consistency_proofs(first: int, second: int, expected: list[str]) -> None:
    proof = merkle.consistency_proof(first, second, over(LEAVES[:second]))
    assert [p.hex() for p in proof] == expected
    merkle.verify_consistency(first=first, second=second, first_root=bytes.fromhex(ROOTS[first]),
                              second_root=bytes.fromhex(ROOTS[second]), path=proof)


def test_every_proof_matches_the_rfc_recursion_and_verifies_up_to_40_leaves() -> None:
    rng = random.Random(9162)
    leaves = [merkle.leaf_hash(rng.randbytes(rng.randint(0, 12))) for _ in range(40)]
    frontier: list[bytes] = []
    for n in range(1, len(leaves) + 1):
        d = leaves[:n]
        frontier, completed, last_path = merkle.append(frontier, n - 1, d[-1])
        assert merkle.frontier_root(frontier) == mth(d) == merkle.root(d)
        assert last_path == path(n - 1, d)  # the receipt's path, from the frontier alone
        for start, width, h in completed:  # every subtree this leaf completed, at its place
            assert start + width == n and start % width == 0 and h == mth(d[start:start + width])
        for m in range(n):
            proof = merkle.inclusion_proof(m, n, over(d))
            assert proof == path(m, d)
            merkle.verify_inclusion(index=m, size=n, leaf=d[m], path=proof, root_hash=mth(d))
        for m in range(1, n + 1):
            proof = merkle.consistency_proof(m, n, over(d))
            assert proof == subproof(m, d, True)
            merkle.verify_consistency(first=m, second=n, first_root=mth(d[:m]), second_root=mth(d), path=proof)


def test_needed_subtrees_are_perfect_aligned_and_logarithmic() -> None:
    n = 1000
    for m in (0, 1, 511, 512, 999):
        wanted = merkle.needed_subtrees(lambda s, m=m: merkle.inclusion_proof(m, n, s))
        assert all(merkle.is_power_of_two(w) and s % w == 0 and s + w <= n for s, w in wanted)
        assert len(wanted) <= 2 * n.bit_length()
    wanted = merkle.needed_subtrees(lambda s: merkle.consistency_proof(300, n, s))
    assert len(wanted) <= 2 * n.bit_length()


def test_tampered_proofs_fail() -> None:
    rng = random.Random(1)
    leaves = [merkle.leaf_hash(rng.randbytes(8)) for _ in range(13)]
    r13, r7 = mth(leaves), mth(leaves[:7])
    proof = merkle.inclusion_proof(4, 13, over(leaves))
    flipped = [proof[0][:-1] + bytes([proof[0][-1] ^ 1]), *proof[1:]]
    for kwargs in (
        {"leaf": leaves[5], "path": proof, "index": 4},  # another leaf
        {"leaf": leaves[4], "path": flipped, "index": 4},  # an edited sibling
        {"leaf": leaves[4], "path": proof, "index": 5},  # another position
        {"leaf": leaves[4], "path": proof[:-1], "index": 4},  # too short
        {"leaf": leaves[4], "path": [*proof, proof[0]], "index": 4},  # too long
    ):
        with pytest.raises(merkle.ProofError):
            merkle.verify_inclusion(size=13, root_hash=r13, **kwargs)  # type: ignore[arg-type]
    consistency = merkle.consistency_proof(7, 13, over(leaves))
    edited = list(leaves)
    edited[2] = merkle.leaf_hash(b"rewritten")
    for first_root, second_root, proof_used in (
        (mth(edited[:7]), r13, consistency),  # the held head is of another history
        (r7, mth(edited), merkle.consistency_proof(7, 13, over(edited))),  # the history was rewritten
        (r7, r13, consistency[:-1]),
    ):
        with pytest.raises(merkle.ProofError):
            merkle.verify_consistency(first=7, second=13, first_root=first_root, second_root=second_root, path=proof_used)
    with pytest.raises(merkle.ProofError, match="only grows"):
        merkle.verify_consistency(first=13, second=7, first_root=r13, second_root=r7, path=consistency)
    with pytest.raises(merkle.ProofError, match="same size"):
        merkle.verify_consistency(first=7, second=7, first_root=r7, second_root=mth(edited[:7]), path=[])
