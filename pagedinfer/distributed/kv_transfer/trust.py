"""Which `kv_transfer_params` a decode instance believes (ZmqConnector), and the tag that
makes them unforgeable.

On a kv_consumer the params come with the request, from whoever sent it. Believed blindly,
they let a client choose the host and port the engine connects to, and load another prompt's
KV for its own prompt: the consumer's prefix cache then serves that KV to every later request
with the same prompt (issue 24: the France prompt answered " Berlin." for everyone).

`check_remote` applies, in order:
1. shape: every field present, of its type;
2. address: with `trusted_producers` (`kv_connector_extra_config`, a list of "host:port"),
   the producer must be one of them: no connection is made anywhere else;
3. tag: with a transfer secret (`kv_connector_extra_config["secret"]`, or the environment
   variable `PAGEDINFER_KV_TRANSFER_SECRET`, which keeps it off command lines), `remote_tag`
   must be the HMAC-SHA256 the producer computed over its engine id, host, port, request id,
   prompt length and prompt hash (`sign`): only an instance holding the secret can name a
   held prompt, so the address and the hash are the producer's, not the client's;
4. prompt: the hash must be that of the consumer's own first `remote_num_tokens` tokens.

And the producer checks the pull itself: a pull carries the consumer's prompt hash, and a
hold is served only to a pull naming the hash of the prompt it holds (`server.py`), so even
an instance with neither a secret nor a trusted list never sends one prompt's KV for another.

HTTP servers refuse client `kv_transfer_params` when no secret is configured, unless started
with `--trust-kv-transfer-params` (behind a proxy that sets them): `accepts_client_params`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedinfer import envs
from pagedinfer.distributed.kv_transfer.storage import token_digest

if TYPE_CHECKING:
    from pagedinfer.config import KVTransferConfig

__all__ = [
    "KVTransferRefused",
    "RemotePrefill",
    "accepts_client_params",
    "check_remote",
    "prompt_hash",
    "sign",
    "transfer_secret",
    "trusted_producers",
]


class KVTransferRefused(ValueError):
    """`kv_transfer_params` this instance does not believe; the message names why."""


def prompt_hash(token_ids: list[int]) -> str:
    """A digest of prompt token ids (sent in `kv_transfer_params`)."""
    return token_digest(token_ids)[:32]


def transfer_secret(kv: KVTransferConfig | None) -> bytes | None:
    """The secret shared by the instances, or None: the extra config's "secret", else the
    environment variable."""
    if kv is None:
        return None
    secret = kv.get_from_extra_config("secret", None) or envs.kv_transfer_secret()
    if not secret:
        return None
    if not isinstance(secret, str):
        raise ValueError("kv_connector_extra_config.secret must be a string")
    return secret.encode()


def trusted_producers(kv: KVTransferConfig | None) -> frozenset[tuple[str, int]] | None:
    """The producers a consumer may connect to ("host:port" each), or None: any the other
    checks let through. ValueError for an entry that is not "host:port"."""
    entries = None if kv is None else kv.get_from_extra_config("trusted_producers", None)
    if entries is None:
        return None
    if not isinstance(entries, list):
        raise ValueError('kv_connector_extra_config.trusted_producers: a list of "host:port"')
    trusted = set()
    for entry in entries:
        host, sep, port = str(entry).rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f'kv_connector_extra_config.trusted_producers: {entry!r} is not "host:port"'
            )
        trusted.add((host.strip("[]"), int(port)))
    return frozenset(trusted)


def accepts_client_params(kv: KVTransferConfig | None, trust_endpoint: bool) -> bool:
    """Whether an HTTP server takes `kv_transfer_params` from its clients: only with a
    transfer secret (consumers then check tags) or on an endpoint declared trusted."""
    return trust_endpoint or transfer_secret(kv) is not None


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decode request's prompt KV is held: its `kv_transfer_params`, checked."""

    host: str
    port: int
    engine_id: str
    request_id: str
    num_tokens: int
    prompt_hash: str

    def as_params(self) -> dict[str, Any]:
        """The load spec's `params`, read by the worker's puller."""
        return {
            "host": self.host,
            "port": self.port,
            "engine_id": self.engine_id,
            "request_id": self.request_id,
            "prompt_hash": self.prompt_hash,
        }


def _signed_text(
    engine_id: str, host: str, port: int, request_id: str, num_tokens: int, hash_: str
) -> bytes:
    return json.dumps([engine_id, host, port, request_id, num_tokens, hash_]).encode()


def sign(
    secret: bytes,
    engine_id: str,
    host: str,
    port: int,
    request_id: str,
    num_tokens: int,
    hash_: str,
) -> str:
    """The producer's tag over what its `kv_transfer_params` name."""
    text = _signed_text(engine_id, host, port, request_id, num_tokens, hash_)
    return hmac.new(secret, text, hashlib.sha256).hexdigest()


_FIELDS: dict[str, type] = {
    "remote_host": str,
    "remote_port": int,
    "remote_request_id": str,
    "remote_num_tokens": int,
    "remote_prompt_hash": str,
}


def check_remote(
    params: dict[str, Any] | None, kv: KVTransferConfig | None, prompt: list[int]
) -> RemotePrefill | None:
    """The remote prefill `params` name for this `prompt`, None when they name none (no
    `do_remote_prefill`); KVTransferRefused when this instance must not load it."""
    if not params or params.get("do_remote_prefill") is not True:
        return None
    if kv is None or not kv.is_kv_consumer:
        raise KVTransferRefused("kv_transfer_params: this instance does not load remote KV")
    for name, kind in _FIELDS.items():
        value = params.get(name)
        if type(value) is not kind:
            raise KVTransferRefused(f"kv_transfer_params.{name}: missing or not a {kind.__name__}")
    engine_id = params.get("remote_engine_id") or ""
    if not isinstance(engine_id, str):
        raise KVTransferRefused("kv_transfer_params.remote_engine_id: not a string")
    remote = RemotePrefill(
        host=params["remote_host"],
        port=params["remote_port"],
        engine_id=engine_id,
        request_id=params["remote_request_id"],
        num_tokens=params["remote_num_tokens"],
        prompt_hash=params["remote_prompt_hash"],
    )
    trusted = trusted_producers(kv)
    if trusted is not None and (remote.host, remote.port) not in trusted:
        raise KVTransferRefused(
            f"kv_transfer_params: producer {remote.host}:{remote.port} is not in trusted_producers"
        )
    secret = transfer_secret(kv)
    if secret is not None:
        tag = params.get("remote_tag")
        expected = sign(secret, remote.engine_id, remote.host, remote.port, remote.request_id,
                        remote.num_tokens, remote.prompt_hash)  # fmt: skip
        if not isinstance(tag, str) or not hmac.compare_digest(tag.encode(), expected.encode()):
            raise KVTransferRefused(
                "kv_transfer_params: remote_tag missing or wrong (not signed by a producer "
                "holding this instance's transfer secret)"
            )
    if (
        not 0 < remote.num_tokens <= len(prompt)
        or prompt_hash(prompt[: remote.num_tokens]) != remote.prompt_hash
    ):
        raise KVTransferRefused(
            "kv_transfer_params: remote_prompt_hash is not this request's prompt (KV of "
            "another prompt)"
        )
    return remote
