"""Every environment variable pagedinfer reads, in one place (vLLM's `envs.py`).

Each is read when asked (a function call), not at import, so a test or a launcher that sets
one later is seen. `ENVIRONMENT_VARIABLES` describes them; `docs/configuration.md` lists
them from it. Variables pagedinfer only *sets* for the libraries below it (oneDNN's cache
sizes, in `platform.py`) and those the libraries read themselves (`TORCH_EXTENSIONS_DIR`,
`OMP_NUM_THREADS`) are not here.
"""

from __future__ import annotations

import os

__all__ = [
    "ENVIRONMENT_VARIABLES",
    "block_hash_seed",
    "data_dir",
    "kernel_cflags",
    "kv_transfer_secret",
    "max_cpu_isa",
    "openai_api_key",
    "ray_address",
]

ENVIRONMENT_VARIABLES: dict[str, str] = {
    "PAGEDINFER_DATA_DIR": (
        "Where benchmarks and `train-draft` look for their default dataset when "
        "`--dataset-path` is not given (default: `shared/data` next to the repository)."
    ),
    "PYTHONHASHSEED": (
        "Seeds the prefix-cache block hashes (default `0`): processes that share KV blocks "
        "(data-parallel replicas, prefill and decode instances) must agree on it; set it "
        "to a secret to keep block hashes from being predicted."
    ),
    "RAY_ADDRESS": (
        'The Ray cluster the `ray` executor and data-parallel backend join (default `"auto"`: '
        "the one `ray start` left on this machine); pagedinfer never starts one."
    ),
    "PAGEDINFER_KERNEL_CFLAGS": (
        "Extra compiler flags for the C++ CPU kernels, e.g. `-mno-avx512f` to build and test "
        "the AVX2 paths on an AVX-512 machine (default: none; `-march=native` builds for "
        "this CPU). Each set of flags gets its own build in the extension cache."
    ),
    "PAGEDINFER_MAX_CPU_ISA": (
        "The highest instruction-set tier the C++ CPU kernels may use, as oneDNN's "
        "`ONEDNN_MAX_CPU_ISA` caps its own: `amx`, `avx512`, `avx2` or `none` (plain C++ for "
        "the compiler to vectorise as it can); default: the best tier the CPU reports. A cap "
        "above the CPU's own tier changes nothing. Each tier is its own build; torch's "
        "kernels keep their own caps (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`)."
    ),
    "PAGEDINFER_KV_TRANSFER_SECRET": (
        "The secret disaggregated instances share (as `kv_connector_extra_config.secret` "
        "does, without putting it on a command line): a ZmqConnector producer tags its "
        "`kv_transfer_params` with an HMAC under it, a consumer loads only what carries a "
        "valid tag, and servers take clients' `kv_transfer_params` only when it is set "
        "(or with `--trust-kv-transfer-params`). Default: unset."
    ),
    "OPENAI_API_KEY": (
        "`pagedinfer bench serve`: the bearer token sent to the server when `--api-key` is "
        "not given."
    ),
}


def data_dir() -> str | None:
    """`PAGEDINFER_DATA_DIR`, or None when unset or empty."""
    return os.environ.get("PAGEDINFER_DATA_DIR") or None


def kernel_cflags() -> list[str]:
    """`PAGEDINFER_KERNEL_CFLAGS`, split on whitespace ([] when unset)."""
    return os.environ.get("PAGEDINFER_KERNEL_CFLAGS", "").split()


def kv_transfer_secret() -> str | None:
    """`PAGEDINFER_KV_TRANSFER_SECRET`, or None when unset or empty."""
    return os.environ.get("PAGEDINFER_KV_TRANSFER_SECRET") or None


def max_cpu_isa() -> str | None:
    """`PAGEDINFER_MAX_CPU_ISA`, lower-cased, or None when unset or empty."""
    return os.environ.get("PAGEDINFER_MAX_CPU_ISA", "").strip().lower() or None


def block_hash_seed() -> str:
    """`PYTHONHASHSEED`, or "0"."""
    return os.environ.get("PYTHONHASHSEED") or "0"


def ray_address() -> str:
    """`RAY_ADDRESS`, or "auto"."""
    return os.environ.get("RAY_ADDRESS") or "auto"


def openai_api_key() -> str | None:
    """`OPENAI_API_KEY`, or None when unset or empty."""
    return os.environ.get("OPENAI_API_KEY") or None
