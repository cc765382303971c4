"""The package logger: one stream handler, level from PAGEDSERVE_LOG_LEVEL."""

from __future__ import annotations

import logging

from pagedserve import envs

_ROOT = "pagedserve"
_SAID: set[tuple] = set()  # info_once's keys


def get_logger(name: str) -> logging.Logger:
    root = logging.getLogger(_ROOT)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s",
                                               "%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(envs.log_level())
        root.propagate = False
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")


def info_once(logger: logging.Logger, key: tuple, msg: str, *args: object) -> None:
    """``logger.info`` the first time ``key`` comes in this process: what the engine and its
    rank each resolve alike (the platform ``--device auto`` picks, the folder a model name
    stands for) is said once."""
    if key not in _SAID:
        _SAID.add(key)
        logger.info(msg, *args)
