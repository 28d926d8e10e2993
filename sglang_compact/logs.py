"""Log lines said once per process: the first call with a key logs, later ones are silent.

Each caller logs through its own module's logger; the key (default: the message's format string, before its
arguments are filled in) says which calls count as the same line.
"""

from __future__ import annotations

import logging

_SAID: set[str] = set()


def log_once(logger: logging.Logger, level: int, msg: str, *args, key: str | None = None, **kwargs) -> None:
    """`logger.log(level, msg, *args, **kwargs)` the first time `key` (default `msg`) is seen in this process;
    the record names the caller's line, as a direct `logger.log` would."""
    key = msg if key is None else key
    if key not in _SAID:
        _SAID.add(key)
        kwargs.setdefault("stacklevel", 2)
        logger.log(level, msg, *args, **kwargs)


def reset() -> None:
    """Forget every line said (tests): each is logged again, once."""
    _SAID.clear()
