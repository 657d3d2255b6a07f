"""Loader of pagedinfer's C++ CPU kernels (one extension module built from `csrc/`):

- `paged_decode_attention` (`csrc/paged_attention_cpu.cpp`), with an optional sliding window
  and logit soft cap, reference `attention/torch_ref.py`;
- `paged_prefill_attention` (`csrc/prefill_attention_cpu.cpp`, bfloat16 on AMX tiles, where
  `prefill_attention_available()`), prefills and chunks over a cached prefix;
- `rms_norm`, `fused_add_rms_norm`, `silu_and_mul`, `gelu_tanh_and_mul`, `rotary_embedding`
  (`csrc/layer_ops_cpu.cpp`), the model's fused layer ops;
- `quant_linear` (`csrc/quant_linear_cpu.cpp`), products with the file's Q4/Q8 blocks;
- `argmax_rows` (`csrc/sample_ops_cpu.cpp`), the sampler's row-wise argmax.

The module is compiled with the machine's C++ compiler (torch's `cpp_extension.load`) into
torch's extension cache (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR). `make setup`
builds it ahead of time (`python -m pagedinfer.kernels.build`), so the first `LLM()` only loads
it; otherwise the first use builds it and says so. The module's name carries a digest of the
sources, the flags, torch's version and the CPU's instruction-set flags: checkouts with the
same sources share one build, a changed source or another CPU (a disk moved to a machine
without AMX, say) gets a build of its own, and no two checkouts overwrite each other's.

If the module cannot be built, `load_cpu_kernels()` logs why once and returns None, and every
caller keeps its pure-torch path. Torch reference: `attention/torch_ref.py`.
"""

from __future__ import annotations

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

__all__ = ["cpu_kernels_failure", "is_cpu_kernels_built", "load_cpu_kernels"]

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = (
    "module.cpp",
    "paged_attention_cpu.cpp",
    "prefill_attention_cpu.cpp",
    "layer_ops_cpu.cpp",
    "quant_linear_cpu.cpp",
    "sample_ops_cpu.cpp",
)
# -fno-math-errno lets gcc vectorise expf through glibc's libmvec.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_module: Any = None
_failure: str | None = None


def _cflags() -> list[str]:
    """The flags above plus `PAGEDINFER_KERNEL_CFLAGS` (part of the module's name, so each
    set of flags has its own build)."""
    return _CFLAGS + envs.kernel_cflags()


def _cpu_flags() -> str:
    """The CPU's instruction-set flags: `-march=native` builds for exactly these."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _module_name() -> str:
    import torch

    digest = hashlib.sha1()
    for name in sorted(os.listdir(_CSRC)):
        with open(os.path.join(_CSRC, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    digest.update(" ".join(_cflags() + _LDFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(_cpu_flags().encode())
    return f"pagedinfer_cpu_kernels_{digest.hexdigest()[:12]}"


def _build_dir(name: str) -> str:
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, verbose=False)


def is_cpu_kernels_built() -> bool:
    """Whether the module for these sources and this CPU is already in the cache."""
    name = _module_name()
    return os.path.exists(os.path.join(_build_dir(name), f"{name}.so"))


def load_cpu_kernels() -> Any | None:
    """The compiled extension module, or None when it cannot be built here."""
    global _module, _failure
    with _lock:
        if _module is not None or _failure is not None:
            return _module
        try:
            from torch.utils import cpp_extension

            name = _module_name()
            built = os.path.exists(os.path.join(_build_dir(name), f"{name}.so"))
            if not built:
                logger.warning(
                    "Compiling pagedinfer's C++ CPU kernels (once per machine; about 2 minutes "
                    "on 2 cores; `make setup` does this ahead of time)..."
                )
            start = time.perf_counter()
            _module = cpp_extension.load(
                name=name,
                sources=[os.path.join(_CSRC, source) for source in _SOURCES],
                extra_include_paths=[_CSRC],
                extra_cflags=_cflags(),
                extra_ldflags=_LDFLAGS,
                verbose=False,
            )
            if not built:
                logger.warning("C++ CPU kernels built in %.0f s.", time.perf_counter() - start)
        except Exception as exc:  # no compiler, no ninja, a compile error: keep the torch path
            _failure = f"{type(exc).__name__}: {exc}"
            logger.warning("CPU kernels unavailable (%s); using the torch paths.", _failure)
        return _module


def cpu_kernels_failure() -> str | None:
    """Why the last `load_cpu_kernels()` returned None (None if it did not fail)."""
    return _failure
