"""Optional dependencies: which extra of `pip install 'pagedinfer[...]'` a feature needs.

pyproject.toml keeps the engine's own requirements small; the server, guided decoding, the
Redis connector and Ray are extras. A feature whose extra is missing fails where it is
first asked for, with a message naming the extra, instead of an ImportError from deep inside.
Called by the CLI's `serve`, the structured-output backends, the Redis connector and the
Ray executor; imports nothing of pagedinfer.
"""

from __future__ import annotations

import importlib.util

__all__ = ["MissingExtraError", "missing_modules", "require_extra"]


class MissingExtraError(ImportError):
    """A feature's optional dependencies are not installed; the message names the extra."""


def missing_modules(*modules: str) -> list[str]:
    """The top-level modules among `modules` that are not installed."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def require_extra(extra: str, *modules: str, feature: str) -> None:
    """MissingExtraError naming `extra` when any of `modules` is missing."""
    missing = missing_modules(*modules)
    if missing:
        raise MissingExtraError(
            f"{feature} needs {', '.join(missing)}, which is not installed: "
            f"pip install 'pagedinfer[{extra}]'"
        )
