"""API keys: who may call ``/v1/*``, and which tenant each caller is.

``--api-key`` may name several keys (comma-separated in ``NANOSERVE_API_KEY``). A request must
carry one of them as a Bearer token, compared in constant time against every key. When keys are
configured, every request's prefix-cache salt includes its key's tenant id, so two tenants never
share a cached block: a cache hit is visible in the time to first token, and sharing blocks
across tenants would let one learn what another's prompts begin with (vLLM CVE-2025-46570). The
tenant id is a keyed digest of the key, never the key, and never logged.
"""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

from frontend.errors import ApiError

# Where the middleware stores a request's tenant (None when no keys are configured).
TENANT = web.RequestKey("tenant", object)


def parse_api_keys(raw: str | None) -> tuple[str, ...]:
    """``"k1,k2"`` -> ``("k1", "k2")``; None or blank -> no keys. An empty key is an error."""
    if raw is None or not raw.strip():
        return ()
    keys = tuple(key.strip() for key in raw.split(","))
    if not all(keys):
        raise ValueError("api keys must not be empty (separate several with commas)")
    return keys


def tenant_id(key: str) -> str:
    """A stable id for the holder of ``key`` that does not reveal it."""
    return hashlib.blake2b(key.encode(), digest_size=16, person=b"nanoserve-tenant").hexdigest()


class ApiKeys:
    """The configured keys; ``tenant`` checks a request's Authorization header."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._expected = [(f"Bearer {key}".encode(), tenant_id(key)) for key in keys]

    @property
    def required(self) -> bool:
        """True when requests must carry a key."""
        return bool(self._expected)

    def tenant(self, authorization: str) -> str | None:
        """The tenant of a valid header (None when no keys are configured), or ApiError 401.
        Every key is compared, so the time taken does not tell which one matched."""
        if not self._expected:
            return None
        given = authorization.encode()
        found = None
        for expected, tenant in self._expected:
            if hmac.compare_digest(given, expected):
                found = tenant
        if found is None:
            raise ApiError(401, "invalid or missing API key", code="invalid_api_key")
        return found


def cache_salt(tenant: str | None, requested: str | None) -> str | None:
    """The salt a request's prefix-cache blocks are hashed with: its tenant's id and the salt
    the request asked for, either of which may be absent."""
    if tenant is None:
        return requested
    return tenant if requested is None else f"{tenant}:{requested}"
