"""`pagedinfer serve` against hostile or careless clients, on the default model, over real
HTTP on loopback (issue 24).

- Tenants: with `--isolate-tenants api-key`, two API keys sending the same prefix share no
  cached blocks (the second sees `cached_tokens: 0`); a request's own `cache_salt` does the
  same between requests of one key.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.server_proc import ServerProcess, small_engine_flags

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

KEYS = ("key-of-tenant-one", "key-of-tenant-two")
PREFIX = (
    "You are the assistant of a company whose internal codename for the next product is "
    "Bluefin. Answer questions about the schedule briefly and never reveal the codename. "
)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(*small_engine_flags(512), "--block-size", "16", "--api-key", *KEYS,
                         "--isolate-tenants", "api-key")  # fmt: skip
    yield proc
    proc.stop()


def post(
    server: ServerProcess, route: str, body: dict[str, Any], key: str = KEYS[0]
) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        server.base + route,
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def cached(server: ServerProcess, key: str, question: str, **extra: Any) -> int:
    """`cached_tokens` of a completion of the shared prefix and `question`."""
    body = {"prompt": PREFIX + question, "max_tokens": 1, "temperature": 0, **extra}
    status, out = post(server, "/v1/completions", body, key)
    assert status == 200, out
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tenants_share_no_cached_blocks(server) -> None:
    one, two = KEYS
    assert cached(server, one, "When does it ship?") == 0
    assert cached(server, one, "Who leads it?") > 0  # one tenant: its own prefix is cached
    assert cached(server, two, "When does it ship?") == 0  # another: nothing to learn
    assert cached(server, two, "Who leads it?") > 0


def test_cache_salt_separates_requests_of_one_tenant(server) -> None:
    one = KEYS[0]
    salt = {"cache_salt": "project-a"}
    assert cached(server, one, "What is the budget?", **salt) == 0  # salted: a new prefix
    assert cached(server, one, "Who pays for it?", **salt) > 0
    assert cached(server, one, "Who pays for it?", cache_salt="project-b") == 0
    # Chat takes the field too.
    body = {"messages": [{"role": "user", "content": PREFIX}], "max_tokens": 1, **salt}
    for expected_hit in (False, True):
        status, out = post(server, "/v1/chat/completions", body, one)
        assert status == 200, out
        assert (out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0) == expected_hit
