"""Which earlier requests a request may draft from in ``lattice serve``: one suffix index per tenant.

The output never depends on the index (the target decides every token), but acceptance, and so timing, would
reveal what other requests held: a tenant must never draft from another tenant's text. A tenant is the API key a
request presents (several keys: several tenants) together with the ``speculative.scope`` it sends, if any (a
scope is only ever looked up under the key that sent it, so guessing another tenant's scope name finds nothing).
``--suffix-scope`` (`SUFFIX_SCOPES`):

* ``tenant`` (default): an index per tenant; a server started without ``--api-key`` has one user, whose requests
  (no key) are one tenant (per ``speculative.scope`` they send), as llama-server and vLLM reuse by default;
* ``shared``: one index for every request (the operator trusts all clients with each other's text);
* ``request``: never across requests.

Every index is under ``suffix_budget`` tokens, and before each generation the least recently used tenants'
indexes are dropped until all of them together are too. ``speculative.clear_index`` clears the tenant's index
before its request runs.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from lattice_inference.drafters.suffix_index import SuffixIndex
from lattice_inference.options import check_suffix_scope

SHARED = "*"
"""The one tenant of ``--suffix-scope shared``."""


def tenant_of(mode: str, api_key: str | None, scope: str | None) -> str | None:
    """The tenant a request drafts as (and whose earlier prompt rows it may reuse) under ``mode``: None (its own
    tokens only), or an opaque name (the key is hashed, never kept; no key: the keyless server's one user)."""
    if mode == "request":
        return None
    if mode == "shared":
        return SHARED
    key = hashlib.sha256(api_key.encode()).hexdigest()[:32] if api_key else "-"
    return f"{key}/{scope or ''}"


class SuffixScopes:
    """The server's suffix indexes, one per tenant, under one token ``budget``."""

    def __init__(self, budget: int, mode: str = "tenant") -> None:
        check_suffix_scope(mode)
        self.budget = budget
        self.mode = mode
        self._indexes: OrderedDict[str, SuffixIndex] = OrderedDict()

    def __len__(self) -> int:
        """Tokens held over every tenant."""
        return sum(len(index) for index in self._indexes.values())

    @property
    def tenants(self) -> int:
        """Tenants with an index."""
        return len(self._indexes)

    def clear(self, tenant: str | None) -> None:
        """Forget ``tenant``'s index (nothing for None, whose requests keep no index)."""
        if tenant is not None:
            self._indexes.pop(tenant, None)

    def index_for(self, tenant: str | None) -> SuffixIndex:
        """The index a generation of ``tenant`` drafts from and adds to (a private one for None), made the most
        recently used; older tenants' indexes are dropped until all of them hold at most ``budget`` tokens."""
        if tenant is None:
            return SuffixIndex(self.budget)
        index = self._indexes.pop(tenant, None) or SuffixIndex(self.budget)
        self._indexes[tenant] = index
        while len(self._indexes) > 1 and len(self) > self.budget:
            self._indexes.popitem(last=False)
        return index
