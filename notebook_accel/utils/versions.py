"""Version comparisons with accelerate's names: `compare_versions`, `is_torch_version`."""

from __future__ import annotations

import importlib.metadata
import operator

_OPERATIONS = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}


def _version(value):
    from torch.torch_version import TorchVersion  # PEP 440 ordering, as torch ships it

    return TorchVersion(str(value))


def compare_versions(library_or_version, operation: str, requirement_version: str) -> bool:
    """`library_or_version` (an installed distribution's name, or a version) `operation` `requirement_version`.

    A name that is not an installed distribution but parses as a version is taken as a version.
    """
    if operation not in _OPERATIONS:
        raise ValueError(f"operation must be one of {sorted(_OPERATIONS)}, got {operation!r}")
    version = str(library_or_version)
    try:
        version = importlib.metadata.version(version)
    except importlib.metadata.PackageNotFoundError:
        if not version[:1].isdigit():
            raise ValueError(
                f"{library_or_version!r} is neither an installed distribution nor a version number"
            ) from None
    return _OPERATIONS[operation](_version(version), _version(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    """The installed torch's version `operation` `version`, e.g. is_torch_version(">=", "2.4")."""
    import torch

    return compare_versions(torch.__version__, operation, version)
