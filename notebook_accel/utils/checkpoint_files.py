"""Where a checkpoint folder is, a crashed save's leftovers included, and making its files durable."""

from __future__ import annotations

import logging
import os
from typing import Optional

logger = logging.getLogger(__name__)


def sibling(path: str, tag: str) -> str:
    """The hidden `.NAME.tag` next to `path` (a save's staging folder, the previous one set aside)."""
    parent, name = os.path.split(os.path.normpath(path))
    return os.path.join(parent, f".{name}.{tag}")


def find_checkpoint(path: str) -> Optional[str]:
    """The folder to resume from for the checkpoint `path`, or None when there is none.

    That is `path` itself, or, when a save was killed between its two renames, the previous
    checkpoint it had set aside as the hidden `.NAME.old` (complete; load_state reads it and the
    next save_state moves it back). Use it instead of `os.path.isdir(path)` in resume code.
    """
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return path
    old = sibling(path, "old")
    if os.path.isdir(old):
        logger.warning(
            "%s is missing: a save there was interrupted. The previous checkpoint is complete at %s; "
            "load_state reads it and the next save_state to %s puts it back first.",
            path,
            old,
            path,
        )
        return old
    return None


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make the names in `path` (files created, renamed, removed) survive a power loss."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # platforms that cannot open a folder (Windows) have no folder fsync
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a folder; their renames are then best effort
        pass
    finally:
        os.close(fd)


def fsync_tree(folder: str) -> None:
    """fsync every file under `folder`, then every folder, deepest first, `folder` last."""
    for root, _dirs, files in os.walk(folder, topdown=False):
        for name in files:
            fsync_file(os.path.join(root, name))
        fsync_dir(root)
