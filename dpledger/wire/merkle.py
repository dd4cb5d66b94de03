"""The Merkle tree of RFC 9162 §2.1 (Certificate Transparency 2.0): hashing, proofs and verifiers.

Pure functions over 32-byte SHA-256 digests: no database, no HTTP, so the service builds its roots
and proofs with them and a silo's or an auditor's client checks them with the very same code.

- leaf hash: SHA-256(0x00 || data); inner node: SHA-256(0x01 || left || right); a tree of n > 1
  leaves splits at k, the largest power of two strictly below n (§2.1.1).
- Proofs (PATH §2.1.3.1, PROOF §2.1.4.1) are built through `subtree(start, width)`, the hash of a
  perfect, aligned subtree (width a power of two, start a multiple of it), so a store that keeps
  those hashes answers a proof with O(log n) lookups; `needed_subtrees` names them up front so that
  it can fetch them in one query.
- Verifiers follow §2.1.3.2 and §2.1.4.2 step by step.

Written by hand rather than taken from `pymerkle`: pymerkle's proofs are its own format (1-based
indices, "rule"/"subset" bits, the leaf inside the path), not RFC 9162 audit paths, and its storage
interface rebuilds subtree hashes from leaf ranges behind a per-process cache, where the ledger must
persist them in the same SQL transaction as the entry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

HASH_SIZE = 32
EMPTY_ROOT = hashlib.sha256(b"").digest()  # MTH({}) = HASH(), §2.1.1

Subtree = Callable[[int, int], bytes]  # (start, width) of a perfect aligned subtree → its hash


class ProofError(ValueError):
    """A proof that does not verify, or a request for one that cannot exist."""


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def split(n: int) -> int:
    """k: the largest power of two strictly smaller than n (n ≥ 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def range_hash(start: int, end: int, subtree: Subtree) -> bytes:
    """MTH(D[start:end]) for a range that the RFC's recursion produces (start aligned to the
    largest power of two not above end - start)."""
    width = end - start
    if width <= 0:
        raise ProofError(f"empty range [{start}, {end})")
    if is_power_of_two(width):
        return subtree(start, width)
    k = split(width)
    return node_hash(subtree(start, k), range_hash(start + k, end, subtree))


def root(leaves: Sequence[bytes]) -> bytes:
    """MTH over leaf hashes held in memory: O(n); the reference that the stored log is held to."""
    if not leaves:
        return EMPTY_ROOT

    def subtree(start: int, width: int) -> bytes:
        if width == 1:
            return leaves[start]
        half = width // 2
        return node_hash(subtree(start, half), subtree(start + half, half))

    return range_hash(0, len(leaves), subtree)


def inclusion_proof(index: int, size: int, subtree: Subtree) -> list[bytes]:
    """PATH(index, D[size]) of §2.1.3.1, leaf-side first."""
    if not 0 <= index < size:
        raise ProofError(f"leaf index {index} is not in a tree of size {size}")
    path: list[bytes] = []
    start, end = 0, size
    while end - start > 1:
        k = split(end - start)
        if index < start + k:
            path.append(range_hash(start + k, end, subtree))
            end = start + k
        else:
            path.append(range_hash(start, start + k, subtree))
            start += k
    return path[::-1]


def consistency_proof(first: int, second: int, subtree: Subtree) -> list[bytes]:
    """PROOF(first, D[second]) of §2.1.4.1; empty when first is 0 or equals second."""
    if not 0 <= first <= second:
        raise ProofError(f"no consistency proof from size {first} to size {second}")
    if first == 0 or first == second:
        return []
    path: list[bytes] = []
    start, end, whole = 0, second, True  # SUBPROOF(m, D[start:end], whole)
    m = first
    while True:
        if m == end - start:
            if not whole:
                path.append(range_hash(start, end, subtree))
            break
        k = split(end - start)
        if m <= k:
            path.append(range_hash(start + k, end, subtree))
            end = start + k
        else:
            path.append(range_hash(start, start + k, subtree))
            m -= k
            start += k
            whole = False
    return path[::-1]


def needed_subtrees(build: Callable[[Subtree], object]) -> list[tuple[int, int]]:
    """The (start, width) subtrees that `build` reads: the recursion depends on sizes only, so a
    dry run with placeholder hashes names them before any is fetched."""
    wanted: list[tuple[int, int]] = []

    def record(start: int, width: int) -> bytes:
        wanted.append((start, width))
        return bytes(HASH_SIZE)

    build(record)
    return list(dict.fromkeys(wanted))


def root_from_inclusion(*, index: int, size: int, leaf: bytes, path: Sequence[bytes]) -> bytes:
    """The root that `path` proves `leaf` (at `index`) into, per §2.1.3.2; ProofError if the
    path's length does not fit the tree's shape."""
    if not 0 <= index < size:
        raise ProofError(f"leaf index {index} is not in a tree of size {size}")
    fn, sn, r = index, size - 1, leaf
    for p in path:
        if sn == 0:
            raise ProofError("the inclusion path is longer than the tree is deep")
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while not (fn & 1 or fn == 0):
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise ProofError("the inclusion path is shorter than the tree is deep")
    return r


def verify_inclusion(*, index: int, size: int, leaf: bytes, path: Sequence[bytes], root_hash: bytes) -> None:
    if root_from_inclusion(index=index, size=size, leaf=leaf, path=path) != root_hash:
        raise ProofError(f"leaf {index} is not in the tree of size {size} with that root")


def verify_consistency(*, first: int, second: int, first_root: bytes, second_root: bytes, path: Sequence[bytes]) -> None:
    """§2.1.4.2: the tree of size `second` extends the tree of size `first` by appending only."""
    if not 0 <= first <= second:
        raise ProofError(f"a tree of size {second} cannot extend one of size {first}: a log only grows")
    if first == second:
        if path:
            raise ProofError("two heads of one size need an empty consistency proof")
        if first_root != second_root:
            raise ProofError(f"two different roots for the same size {first}")
        return
    if first == 0:
        return  # the empty tree is a prefix of every tree
    if not path:
        raise ProofError("an empty consistency proof between different sizes")
    proof = [first_root, *path] if is_power_of_two(first) else list(path)
    fn, sn = first - 1, second - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = proof[0]
    for c in proof[1:]:
        if sn == 0:
            raise ProofError("the consistency proof is longer than the tree is deep")
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                while not (fn & 1 or fn == 0):
                    fn >>= 1
                    sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise ProofError("the consistency proof is shorter than the tree is deep")
    if fr != first_root:
        raise ProofError(f"the tree of size {second} does not start with the tree of size {first} held")
    if sr != second_root:
        raise ProofError(f"the consistency proof does not lead to the root of the tree of size {second}")


# --- the compact range: how the log appends in O(1) amortised and knows its root in O(log n) -----

def frontier_widths(size: int) -> list[int]:
    """Widths of the perfect subtrees a tree of `size` leaves decomposes into, left to right."""
    return [1 << bit for bit in range(size.bit_length() - 1, -1, -1) if size >> bit & 1]


def frontier_root(frontier: Sequence[bytes]) -> bytes:
    """The root from the frontier (the roots of those perfect subtrees, left to right)."""
    if not frontier:
        return EMPTY_ROOT
    r = frontier[-1]
    for h in reversed(frontier[:-1]):
        r = node_hash(h, r)
    return r


def append(frontier: Sequence[bytes], size: int, leaf: bytes) -> tuple[list[bytes], list[tuple[int, int, bytes]], list[bytes]]:
    """Appends `leaf` as index `size`. Returns the new frontier, the perfect subtrees that this leaf
    completes as (start, width, hash) with width ≥ 2, and the new leaf's inclusion path in the tree
    of size + 1: the old frontier right to left (every earlier subtree lies to its left)."""
    path = list(reversed(frontier))
    stack, completed = list(frontier), []
    carry, width = leaf, 1
    while (size + 1) % (width * 2) == 0:
        carry = node_hash(stack.pop(), carry)
        width *= 2
        completed.append((size + 1 - width, width, carry))
    stack.append(carry)
    return stack, completed, path
