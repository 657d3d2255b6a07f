"""`python -m pagedinfer.kernels.build`: compile the C++ CPU kernels ahead of time.

Run by `make setup`, so that the first `LLM()` or `pagedinfer serve` loads a built module
instead of compiling it silently. It prints one line before and one after. A failed build is
reported once and exits 0: the engine then runs on its pure-torch paths, which is slower but
correct, and setup goes on.
"""

from __future__ import annotations

import logging
import sys
import time

from pagedinfer.kernels.cpu import cpu_kernels_failure, is_cpu_kernels_built, load_cpu_kernels


def main() -> int:
    if is_cpu_kernels_built():
        print("pagedinfer: C++ CPU kernels already built.", flush=True)
        return 0
    print("pagedinfer: building the C++ CPU kernels (about a minute on 2 cores)...", flush=True)
    # The loader's own warnings say the same; keep this command's output to two lines.
    logging.getLogger("pagedinfer.kernels.cpu").setLevel(logging.ERROR)
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
