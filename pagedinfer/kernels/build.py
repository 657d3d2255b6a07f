"""`python -m pagedinfer.kernels.build`: compile the C++ CPU kernels ahead of time.

`make setup` runs it as a plain file (`python pagedinfer/kernels/build.py`) while the other
packages install: it then needs only torch and ninja, not the package's imports. Built ahead,
the first `LLM()` or `pagedinfer serve` loads the module instead of compiling it silently. It
prints one line before and one after. A failed build is reported once and exits 0: the engine
then runs on its pure-torch paths, slower but correct, and setup goes on.
"""

from __future__ import annotations

import logging
import sys
import time

if __package__:
    from pagedinfer.kernels.cpu import (
        cpu_kernels_failure,
        is_cpu_kernels_built,
        load_cpu_kernels,
        logger,
    )
else:  # run as a file: the sibling module, without importing pagedinfer/__init__.py
    # and envs.py loaded by its path (it imports only `os`) for cpu.py to find.
    import importlib.util
    import os

    _envs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "envs.py")
    _spec = importlib.util.spec_from_file_location("_pagedinfer_envs", _envs)
    assert _spec is not None and _spec.loader is not None
    sys.modules["_pagedinfer_envs"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["_pagedinfer_envs"])
    from cpu import cpu_kernels_failure, is_cpu_kernels_built, load_cpu_kernels, logger  # type: ignore[import-not-found, no-redef]


def main() -> int:
    try:
        return _build()
    except Exception as exc:  # torch itself missing or broken: say so once, setup goes on
        print(f"pagedinfer: the C++ CPU kernels were not built ({type(exc).__name__}: {exc}).")
        return 0


def _build() -> int:
    if is_cpu_kernels_built():
        print("pagedinfer: C++ CPU kernels already built.", flush=True)
        return 0
    print("pagedinfer: building the C++ CPU kernels (about a minute on 2 cores)...", flush=True)
    # The loader's own warnings say the same; keep this command's output to two lines.
    logger.setLevel(logging.ERROR)
    start = time.perf_counter()
    module = load_cpu_kernels()
    if module is None:
        print(
            f"pagedinfer: the C++ CPU kernels could not be built ({cpu_kernels_failure()}); "
            "the engine will run on its pure-torch paths.",
            flush=True,
        )
        return 0
    print(f"pagedinfer: C++ CPU kernels built in {time.perf_counter() - start:.0f} s.", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
