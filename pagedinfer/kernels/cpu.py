"""Loader of pagedinfer's C++ CPU kernels (one extension module built from `csrc/`):

- `paged_decode_attention` (`csrc/paged_attention_cpu.cpp`), with an optional sliding window
  and logit soft cap, reference `attention/torch_ref.py`;
- `paged_prefill_attention` (`csrc/prefill_attention_cpu.cpp`, bfloat16 on AMX tiles or
  AVX-512-BF16, where `prefill_attention_available()`), prefills and chunks over a cached prefix;
- `rms_norm`, `fused_add_rms_norm`, `silu_and_mul`, `gelu_tanh_and_mul`, `rotary_embedding`
  (`csrc/layer_ops_cpu.cpp`), the model's fused layer ops;
- `quant_linear` (`csrc/quant_linear_cpu.cpp`), products with the file's Q4/Q8 blocks, and
  `kquant_linear` (`csrc/kquant_linear_cpu.cpp`) with its Q5_0/Q4_K/Q5_K/Q6_K blocks;
- `argmax_rows` (`csrc/sample_ops_cpu.cpp`), the sampler's row-wise argmax.

One source, one build per instruction-set tier (`ISA_TIERS`: `none` < `avx2` < `avx512` <
`amx` on x86; ARM has its native NEON build only). The sources test the compiler's macros
(`__AVX512F__`, `__AMX_BF16__`, `__F16C__`, ...) and take the best path each tier allows; a
tier's build is `-march=native` with the higher tiers' extensions switched off
(`_TIER_CFLAGS`). At run time the loader picks the best tier the CPU reports
(`/proc/cpuinfo`), capped by `PAGEDINFER_MAX_CPU_ISA` (as `ONEDNN_MAX_CPU_ISA` caps oneDNN),
so every tier below a machine's own can be built, run and tested on it.

The module is compiled with the machine's C++ compiler (torch's `cpp_extension.load`) into
torch's extension cache (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR). `make setup`
builds it ahead of time (`python -m pagedinfer.kernels.build`), so the first `LLM()` only loads
it; otherwise the first use builds it and says so. The module's name carries its tier and a
digest of the sources, the flags, torch's version and the CPU's instruction-set flags:
checkouts with the same sources share one build, a changed source or another CPU (a disk
moved to a machine without AMX, say) gets a build of its own, and no two checkouts overwrite
each other's.

If the module cannot be built, `load_cpu_kernels()` logs why once and returns None, and every
caller keeps its pure-torch path. Torch reference: `attention/torch_ref.py`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import threading
import time
from typing import Any

if __package__:
    from pagedinfer import envs
else:  # loaded by build.py run as a plain file (`make setup`), before pagedinfer installs
    import _pagedinfer_envs as envs  # type: ignore[import-not-found, no-redef]

logger = logging.getLogger(__name__)

__all__ = [
    "ISA_TIERS",
    "cpu_isa",
    "cpu_kernels_failure",
    "is_cpu_kernels_built",
    "kernel_isa",
    "load_cpu_kernels",
]

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = (
    "module.cpp",
    "paged_attention_cpu.cpp",
    "prefill_attention_cpu.cpp",
    "layer_ops_cpu.cpp",
    "quant_linear_cpu.cpp",
    "kquant_linear_cpu.cpp",
    "sample_ops_cpu.cpp",
)
# -fno-math-errno lets gcc vectorise expf through glibc's libmvec.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
_LDFLAGS = ["-fopenmp"]

ISA_TIERS = ("none", "avx2", "avx512", "amx")  # x86, lowest first
# Added to -march=native: switch off what a tier must not use. gcc's dependencies do the
# rest (-mno-avx512f takes every AVX-512 extension with it, -mno-avx takes AVX2, FMA and
# F16C, -mno-amx-tile the AMX-BF16/INT8 instructions).
_TIER_CFLAGS = {
    "amx": [],
    "avx512": ["-mno-amx-tile"],
    "avx2": ["-mno-avx512f", "-mno-amx-tile"],
    "none": ["-mno-avx", "-mno-amx-tile"],
}
_ARM_TIER = "neon"
# What /proc/cpuinfo must list for each x86 tier (the sources' paths need these).
_TIER_CPU_FLAGS = {
    "amx": {"amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512_bf16"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx2": {"avx2", "fma", "f16c"},
}

_lock = threading.Lock()
_modules: dict[str, Any] = {}
_failures: dict[str, str] = {}


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@functools.cache
def _cpu_flags() -> str:
    """The CPU's instruction-set flags: `-march=native` builds for exactly these (read once:
    every `load_cpu_kernels()` call asks)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_isa() -> str:
    """The best kernel tier this CPU supports ("neon" on ARM)."""
    if not _is_x86():
        return _ARM_TIER
    flags = set(_cpu_flags().split())
    for tier in reversed(ISA_TIERS[1:]):
        if _TIER_CPU_FLAGS[tier] <= flags:
            return tier
    return "none"


def kernel_isa() -> str:
    """The tier `load_cpu_kernels()` builds and loads: the CPU's own, capped by
    `PAGEDINFER_MAX_CPU_ISA`. Raises ValueError naming the valid tiers for an unknown cap."""
    native = cpu_isa()
    cap = envs.max_cpu_isa()
    if cap is None:
        return native
    if cap not in ISA_TIERS:
        raise ValueError(
            f"PAGEDINFER_MAX_CPU_ISA={cap!r} is not a kernel tier; use one of "
            f"{', '.join(ISA_TIERS)} (lowest first)"
        )
    if native == _ARM_TIER:
        return native  # one tier on ARM: load_cpu_kernels says the cap was not applied
    return min(cap, native, key=ISA_TIERS.index)


def _check_tier(isa: str) -> None:
    native = cpu_isa()
    if isa == native:
        return
    known = native != _ARM_TIER and isa in ISA_TIERS
    if not known or ISA_TIERS.index(isa) > ISA_TIERS.index(native):
        raise ValueError(f"kernel tier {isa!r} cannot run on this CPU (its tier: {native})")


def _cflags(isa: str) -> list[str]:
    """The base flags, the tier's, then `PAGEDINFER_KERNEL_CFLAGS` (all part of the module's
    name, so each set of flags has its own build)."""
    return _CFLAGS + _TIER_CFLAGS.get(isa, []) + envs.kernel_cflags()


def _module_name(isa: str) -> str:
    import torch

    digest = hashlib.sha1()
    for name in sorted(os.listdir(_CSRC)):
        with open(os.path.join(_CSRC, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    digest.update(" ".join(_cflags(isa) + _LDFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(_cpu_flags().encode())
    return f"pagedinfer_cpu_kernels_{isa}_{digest.hexdigest()[:12]}"


def _build_dir(name: str) -> str:
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, verbose=False)


def is_cpu_kernels_built(isa: str | None = None) -> bool:
    """Whether the module of tier `isa` (default `kernel_isa()`) for these sources and this
    CPU is already in the cache."""
    name = _module_name(isa or kernel_isa())
    return os.path.exists(os.path.join(_build_dir(name), f"{name}.so"))


def load_cpu_kernels(isa: str | None = None) -> Any | None:
    """The compiled extension module of tier `isa` (default: `kernel_isa()`), or None when
    it cannot be built here. A tier above the CPU's own is a ValueError."""
    isa = isa or kernel_isa()
    _check_tier(isa)
    with _lock:
        if isa in _modules or isa in _failures:
            return _modules.get(isa)
        cap = envs.max_cpu_isa()
        if cap is not None and isa == _ARM_TIER and cap != _ARM_TIER:
            logger.warning("PAGEDINFER_MAX_CPU_ISA=%s ignored: ARM has one tier (NEON).", cap)
        try:
            from torch.utils import cpp_extension

            name = _module_name(isa)
            built = os.path.exists(os.path.join(_build_dir(name), f"{name}.so"))
            if not built:
                logger.warning(
                    "Compiling pagedinfer's C++ CPU kernels, tier %s (once per machine; about "
                    "a minute on 2 cores; `make setup` does this ahead of time)...",
                    isa,
                )
            start = time.perf_counter()
            _modules[isa] = cpp_extension.load(
                name=name,
                sources=[os.path.join(_CSRC, source) for source in _SOURCES],
                extra_include_paths=[_CSRC],
                extra_cflags=_cflags(isa),
                extra_ldflags=_LDFLAGS,
                verbose=False,
            )
            if not built:
                logger.warning("C++ CPU kernels built in %.0f s.", time.perf_counter() - start)
        except Exception as exc:  # no compiler, no ninja, a compile error: keep the torch path
            _failures[isa] = f"{type(exc).__name__}: {exc}"
            logger.warning("CPU kernels unavailable (%s); using the torch paths.", _failures[isa])
        if isa in _modules:
            logger.info("C++ CPU kernels: tier %s (this CPU: %s).", isa, cpu_isa())
        return _modules.get(isa)


def cpu_kernels_failure(isa: str | None = None) -> str | None:
    """Why the last `load_cpu_kernels(isa)` returned None (None if it did not fail)."""
    return _failures.get(isa or kernel_isa())
