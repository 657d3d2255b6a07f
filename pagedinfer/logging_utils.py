"""Logging set-up for every pagedinfer process: the front end, the engine core, the workers.

`setup_logging()` gives the "pagedinfer" logger one stderr handler at INFO (once: a second call,
or an application that configured the logger itself, changes nothing) and stops it propagating
to the root logger. `LLM`, `AsyncLLM.from_options` and the engine core process call it.
`setup_worker_logging(rank)` configures the root logger of a worker process (the multi-process
executor's child, the Ray actor), each line tagged with the rank.

A leaf module (stdlib only): every layer may import it.
"""

from __future__ import annotations

import logging

__all__ = ["setup_logging", "setup_worker_logging"]


def setup_logging() -> None:
    root = logging.getLogger("pagedinfer")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s %(name)s] %(message)s", "%m-%d %H:%M:%S")
        )
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False


def setup_worker_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(levelname)s %(asctime)s [worker {rank}] %(message)s",
        datefmt="%H:%M:%S",
    )
