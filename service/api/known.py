"""What a serving process keeps between approvals so that a repeated one is a single write transaction.

A key's principal: its role and silo are fixed when it is issued, and the approval's write
transaction reads the key again (keys.require_live) before it writes, so a revoked key still writes
nothing, and is forgotten here (its next request is refused before it is priced). A silo's pricing
terms (charges.SiloTerms): fixed at registration, and compared with the locked record before the
charge is approved. A key that is not known here (an unknown one included) is authenticated by a
read first, as on every other route: no write transaction starts for it.
"""

from __future__ import annotations

from fastapi.security import HTTPAuthorizationCredentials

from dpledger.service.api.deps import Principal
from dpledger.service.ledger import keys
from dpledger.service.ledger.charges import SiloTerms

# Each map is emptied when it reaches this size: a process serving more keys or silos than this
# between two clears pays the read it would have paid anyway, and memory stays bounded.
LIMIT = 4096


class Known:
    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._principals: dict[str, Principal] = {}  # by the key's SHA-256, never the key itself
        self._terms: dict[int, SiloTerms] = {}

    def principal(self, credentials: HTTPAuthorizationCredentials | None) -> Principal | None:
        return None if credentials is None else self._principals.get(keys.hash_key(credentials.credentials))

    def terms(self, silo_id: int) -> SiloTerms | None:
        return self._terms.get(silo_id)

    def remember(self, credentials: HTTPAuthorizationCredentials, caller: Principal, silo_id: int, terms: SiloTerms) -> None:
        for found in (self._principals, self._terms):
            if len(found) >= self.limit:
                found.clear()
        self._principals[keys.hash_key(credentials.credentials)] = caller
        self._terms[silo_id] = terms

    def forget(self, credentials: HTTPAuthorizationCredentials | None) -> None:
        """A key found revoked: its next request is authenticated by a read again, refused before it is priced."""
        if credentials is not None:
            self._principals.pop(keys.hash_key(credentials.credentials), None)
