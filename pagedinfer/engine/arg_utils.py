"""Engine options as command-line flags, generated from the config dataclasses.

vLLM's `engine/arg_utils.py` idea: every field of the sections in
`config.FLAT_OPTION_SECTIONS` becomes `--field-name` (booleans `--x/--no-x`, Literals
`choices`), with the field's docstring as help and its default, and `engine_kwargs` turns the
parsed flags back into the keyword options `LLM(...)` takes; `speculative_config` and
`kv_transfer_config` are JSON objects. One definition, so the CLI, the keyword options and the
docs cannot drift apart.

Callers: `entrypoints/cli.py` (generate, chat, serve) and `bench/offline.py` (throughput,
latency).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from typing import Any

from pagedinfer.config import FLAT_OPTION_SECTIONS

__all__ = ["add_engine_args", "engine_kwargs"]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the "engine options" group: one flag per field of the flat option sections
    (`model` excepted: each command declares it, positional), and the two JSON configs."""
    group = parser.add_argument_group("engine options")
    for _, cls in FLAT_OPTION_SECTIONS:
        hints = typing.get_type_hints(cls)
        fields = cls.__pydantic_fields__
        for f in dataclasses.fields(cls):
            if f.name == "model":
                continue  # positional argument
            flag = "--" + f.name.replace("_", "-")
            help_text = (fields[f.name].description or "").replace("%", "%%")
            default = fields[f.name].get_default(call_default_factory=True)
            hint = hints[f.name]
            args = typing.get_args(hint)
            if hint is bool:
                group.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
                )
            elif typing.get_origin(hint) is typing.Literal:
                group.add_argument(flag, choices=list(args), default=default, help=help_text)
            elif any(typing.get_origin(a) is typing.Literal for a in args):
                # Optional[Literal[...]]: the choices, None when the flag is not given.
                (literal,) = [a for a in args if typing.get_origin(a) is typing.Literal]
                group.add_argument(
                    flag, choices=list(typing.get_args(literal)), default=default, help=help_text
                )
            else:
                base = next((a for a in args if a is not type(None)), hint) if args else hint
                group.add_argument(
                    flag, type=base, default=default, help=f"{help_text} (default: {default})"
                )
    group.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        help='Speculative decoding, as JSON: {"method": "ngram"|"draft_model"|"eagle"|'
        '"medusa", "num_speculative_tokens": k, ...} (see SpeculativeConfig; default: off)',
    )
    group.add_argument(
        "--kv-transfer-config",
        type=_json_object,
        default=None,
        help='KV transfer between instances (disaggregated prefill), as JSON: {"kv_connector": '
        '"SharedStorageConnector"|"RedisConnector"|"ZmqConnector", "kv_role": "kv_producer"|'
        '"kv_consumer"|"kv_both", ...} (see KVTransferConfig; default: off)',
    )


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """The engine options of parsed flags, as `LLM(**kwargs)` and
    `AsyncLLM.from_options(**kwargs)` take them (`config.build_engine_config` routes them)."""
    out: dict[str, Any] = {
        "model": ns.model,
        "speculative_config": ns.speculative_config,
        "kv_transfer_config": ns.kv_transfer_config,
    }
    for _, cls in FLAT_OPTION_SECTIONS:
        for f in dataclasses.fields(cls):
            if f.name != "model":
                out[f.name] = getattr(ns, f.name)
    return out
