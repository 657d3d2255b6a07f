"""Loader of pagedinfer's C++ CPU kernels (one extension module built from `csrc/`):

- `paged_decode_attention` (`csrc/paged_attention_cpu.cpp`), reference `attention/torch_ref.py`;
- `paged_prefill_attention` (`csrc/prefill_attention_cpu.cpp`, bfloat16 on AMX tiles, where
  `prefill_attention_available()`), prefills and chunks over a cached prefix;
- `rms_norm`, `fused_add_rms_norm`, `silu_and_mul`, `rotary_embedding`
  (`csrc/layer_ops_cpu.cpp`), the model's fused layer ops;
- `quant_linear` (`csrc/quant_linear_cpu.cpp`), products with the file's Q4/Q8 blocks;
- `argmax_rows` (`csrc/sample_ops_cpu.cpp`), the sampler's row-wise argmax.

The extension is compiled on first use with the machine's C++ compiler (torch's
`cpp_extension.load`, cached under ~/.cache/torch_extensions, so later processes load it in
well under a second). If it cannot be built, `load_cpu_kernels()` returns None and the
attention backend keeps its pure-torch path. Torch reference: `attention/torch_ref.py`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["load_cpu_kernels"]

_lock = threading.Lock()
_module: Any = None
_failed = False


def load_cpu_kernels() -> Any | None:
    """The compiled extension module, or None when it cannot be built here."""
    global _module, _failed
    with _lock:
        if _module is not None or _failed:
            return _module
        try:
            from torch.utils import cpp_extension

            csrc = os.path.join(os.path.dirname(__file__), "csrc")
            # One build directory per checkout: torch caches builds by name, and two
            # checkouts sharing a name rebuilt each other's module on every load.
            tag = hashlib.sha1(os.path.abspath(csrc).encode()).hexdigest()[:10]
            _module = cpp_extension.load(
                name=f"pagedinfer_cpu_kernels_{tag}",
                sources=[
                    os.path.join(csrc, name)
                    for name in (
                        "module.cpp",
                        "paged_attention_cpu.cpp",
                        "prefill_attention_cpu.cpp",
                        "layer_ops_cpu.cpp",
                        "quant_linear_cpu.cpp",
                        "sample_ops_cpu.cpp",
                    )
                ],
                extra_include_paths=[csrc],
                # -fno-math-errno lets gcc vectorise expf through glibc's libmvec.
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as exc:  # no compiler, no ninja, ...: keep the torch path
            logger.warning("CPU kernels unavailable (%s); using the torch paths.", exc)
            _failed = True
        return _module
