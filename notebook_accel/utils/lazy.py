"""Names a module exports from a sibling that is imported on first use (a module __getattr__)."""

from __future__ import annotations

import importlib


def lazy_exports(namespace: dict, table: dict):
    """A module `__getattr__` for `namespace` (its globals()) resolving `table` {name: sibling}.

    The value is cached in `namespace`, so each name is looked up once.
    """

    def __getattr__(name: str):
        sibling = table.get(name)
        if sibling is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{sibling}", namespace["__package__"]), name)
        namespace[name] = value
        return value

    return __getattr__
