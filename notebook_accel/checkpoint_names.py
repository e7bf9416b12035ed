"""Automatic checkpoint folders of a project (`ProjectConfiguration(automatic_checkpoint_naming=True)`):
`{project_dir}/checkpoints/checkpoint_{N}`, the next one's name, the saved ones in order, and the
rotation that keeps `total_limit` of them. checkpointing.py writes and reads what is inside."""

from __future__ import annotations

import os
import re
import shutil
from typing import Optional

from .utils.checkpoint_files import find_checkpoint, sibling

CHECKPOINTS_FOLDER = "checkpoints"


def _checkpoints_root(project_config) -> str:
    if not project_config.project_dir:
        raise ValueError(
            "Automatic checkpoint naming needs a project folder: pass ProjectConfiguration(project_dir=...) "
            "or Accelerator(project_dir=...)."
        )
    return os.path.join(project_config.project_dir, CHECKPOINTS_FOLDER)


def next_checkpoint_dir(project_config) -> str:
    """`{project_dir}/checkpoints/checkpoint_{iteration}`; refuses a folder that exists or is older than one that does."""
    if not project_config.automatic_checkpoint_naming:
        raise ValueError(
            "ProjectConfiguration(automatic_checkpoint_naming=False): pass an output folder to save_state, "
            "or turn automatic naming on."
        )
    path = os.path.join(_checkpoints_root(project_config), f"checkpoint_{project_config.iteration}")
    if os.path.exists(path) or find_checkpoint(path) is not None:
        raise FileExistsError(
            f"{path} already exists: a fresh run would overwrite it. Resume with load_state (which moves the "
            "iteration on), or set project_config.iteration to the next free number."
        )
    saved = list_checkpoints(project_config)
    latest = checkpoint_number(saved[-1]) if saved else -1
    if latest > project_config.iteration:
        # It would sort before the existing ones, and total_limit rotation would delete it at once.
        raise FileExistsError(
            f"{saved[-1]} is newer than the checkpoint_{project_config.iteration} this save would write. Resume with "
            f"load_state (which moves the iteration on), or set project_config.iteration to {latest + 1}."
        )
    return path


def checkpoint_number(path: str) -> Optional[int]:
    """N of an automatic checkpoint folder (checkpoint_N, or .checkpoint_N.old set aside by a killed save)."""
    match = re.fullmatch(r"\.?checkpoint_(\d+)(?:\.old)?", os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def list_checkpoints(project_config) -> list:
    """The automatic checkpoint folders, oldest first (checkpoint_10 after checkpoint_9).

    A checkpoint whose folder a killed save left set aside is listed at its `.checkpoint_N.old`.
    """
    root = _checkpoints_root(project_config)
    if not os.path.isdir(root):
        return []
    numbered = {}
    for name in os.listdir(root):
        match = re.fullmatch(r"\.?checkpoint_(\d+)(\.old)?", name)
        if match and (name[0] == ".") == bool(match.group(2)):
            path = find_checkpoint(os.path.join(root, name.lstrip(".").removesuffix(".old")))
            if path is not None:
                numbered[int(match.group(1))] = path
    return [numbered[n] for n in sorted(numbered)]


def rotate_checkpoints(project_config) -> list:
    """Delete the oldest automatic checkpoints beyond `total_limit`; returns the deleted folders.

    Call after a save has completed, on the main process, so the newest checkpoint is never at risk.
    """
    limit = project_config.total_limit
    if limit is None:
        return []
    doomed = list_checkpoints(project_config)[:-limit]
    for path in doomed:
        # Renamed first so a crash mid-delete never leaves a half-deleted folder that looks real.
        trash = sibling(path, "deleting")
        os.rename(path, trash)
        shutil.rmtree(trash)
    return doomed
