"""What admission reads of one client request: its class, its tenant, its cost.

    class   `x-pdreg-priority: NAME`, if the request's API key may use that class (403
            otherwise; 400 for a class that does not exist); else its key's class; else
            the default class
    tenant  the API key's tenant (`--classes` keys); with no keys configured, the
            `x-pdreg-tenant` header (a client may then name any tenant: configure keys
            where tenants must not be able to pose as each other); else "default"
    cost    the prompt's tokens, exact where the `kv` policy tokenized it, else the body's
            bytes / 4; the answer's, `max_tokens` (or `max_completion_tokens`), else
            DEFAULT_ANSWER_TOKENS
"""

from __future__ import annotations

import re
from typing import Any, Final

from router.admission.classes import ApiKey, ClassBook
from router.admission.tickets import Cost, Who
from router.choice import Affinity
from serving.http_messages import INVALID_REQUEST, Request, Response, openai_error

__all__ = ["PRIORITY_HEADER", "TENANT_HEADER", "cost_of", "key_of", "who_of"]

PRIORITY_HEADER: Final = b"x-pdreg-priority"
TENANT_HEADER: Final = b"x-pdreg-tenant"
DEFAULT_TENANT: Final = "default"
BYTES_PER_TOKEN: Final = 4  # a prompt's tokens when not tokenized: about 4 bytes each
DEFAULT_ANSWER_TOKENS: Final = 256  # KV a request without max_tokens is charged for
MAX_ANSWER_TOKENS: Final = 1 << 20
_TENANT: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,63}$")


def key_of(book: ClassBook, request: Request) -> ApiKey | None:
    """The `--classes` key the request presents (Authorization: Bearer KEY), if any."""
    header = request.headers.get(b"authorization", b"")
    if not book.keys or not header.startswith(b"Bearer "):
        return None
    return book.key_of(header[len(b"Bearer "):])


def who_of(book: ClassBook, request: Request, key: ApiKey | None) -> Who | Response:
    asked = request.header(PRIORITY_HEADER).strip()
    klass = book.resolve(asked, key)
    if klass is None:
        if asked in book.classes:
            return openai_error(403, f"this API key may not use class {asked!r}",
                                "permission_error", "class_not_allowed")
        return openai_error(400, f"unknown class {asked[:64]!r} in x-pdreg-priority",
                            INVALID_REQUEST, "unknown_class")
    if key is not None:
        tenant = key.tenant
    elif book.keys:
        tenant = DEFAULT_TENANT  # the router's own --api-key: the operator's traffic
    else:
        tenant = request.header(TENANT_HEADER).strip() or DEFAULT_TENANT
        if not _TENANT.match(tenant):
            return openai_error(400, "x-pdreg-tenant: 1-64 letters, digits, _ . : @ -",
                                INVALID_REQUEST, "bad_tenant")
    return Who(klass, tenant, book.weight_of(klass, key))


def cost_of(request: Request, body: dict[str, Any], affinity: Affinity) -> Cost:
    prompt_tokens = getattr(affinity, "prompt_tokens", 0) or len(request.body) // BYTES_PER_TOKEN
    answer = body.get("max_tokens", body.get("max_completion_tokens"))
    if isinstance(answer, bool) or not isinstance(answer, int) or answer < 0:
        answer = DEFAULT_ANSWER_TOKENS
    return Cost(max(1, prompt_tokens), min(answer, MAX_ANSWER_TOKENS))
