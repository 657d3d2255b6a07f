"""Thin wrapper over the C++ paged decode-attention kernel (`csrc/paged_attention_cpu.cpp`).

The extension is compiled on first use with the machine's C++ compiler (torch's
`cpp_extension.load`, cached under ~/.cache/torch_extensions, so later processes load it in
well under a second). If it cannot be built, `load_paged_attention()` returns None and the
attention backend keeps its pure-torch path. Torch reference: `attention/torch_ref.py`.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["load_paged_attention"]

_lock = threading.Lock()
_module: Any = None
_failed = False


def load_paged_attention() -> Any | None:
    """The compiled extension module (with `paged_decode_attention`), or None."""
    global _module, _failed
    with _lock:
        if _module is not None or _failed:
            return _module
        try:
            from torch.utils import cpp_extension

            src = os.path.join(os.path.dirname(__file__), "csrc", "paged_attention_cpu.cpp")
            _module = cpp_extension.load(
                name="pagedinfer_paged_attention_cpu",
                sources=[src],
                # -fno-math-errno lets gcc vectorise expf through glibc's libmvec.
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as exc:  # no compiler, no ninja, ...: keep the torch path
            logger.warning("Paged attention kernel unavailable (%s); using the torch path.", exc)
            _failed = True
        return _module
