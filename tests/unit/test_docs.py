"""The README documents every engine option, sampling parameter and CLI command."""

from __future__ import annotations

import dataclasses
import os

from pagedinfer.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from pagedinfer.entrypoints.cli import build_parser
from pagedinfer.sampling_params import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_readme_opens_with_make_run_and_make_test() -> None:
    head = _readme()[:400]
    assert "make run" in head and "make test" in head


def test_every_engine_option_is_documented() -> None:
    readme = _readme()
    for cls in (
        ModelConfig,
        CacheConfig,
        SchedulerConfig,
        ObservabilityConfig,
        StructuredOutputsConfig,
        ParallelConfig,
    ):
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in readme, f.name
            if f.name != "model":
                assert f"--{f.name.replace('_', '-')}" in readme, f.name


def test_every_speculative_config_key_is_documented() -> None:
    readme = _readme()
    assert "`speculative_config`" in readme and "--speculative-config" in readme
    for f in dataclasses.fields(SpeculativeConfig):
        assert f"| `{f.name}` |" in readme, f.name


def test_every_kv_transfer_config_key_is_documented() -> None:
    readme = _readme()
    assert "`kv_transfer_config`" in readme and "--kv-transfer-config" in readme
    for f in dataclasses.fields(KVTransferConfig):
        assert f"| `{f.name}` |" in readme, f.name


def test_every_sampling_param_is_documented() -> None:
    readme = _readme()
    internal = {"all_stop_token_ids", "output_text_buffer_length"}
    for name in SamplingParams.__struct_fields__:
        if name not in internal:
            assert f"`{name}`" in readme, name


def test_every_cli_command_has_an_example() -> None:
    readme = _readme()
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for command in sub.choices:
        assert f"pagedinfer {command}" in readme, command
