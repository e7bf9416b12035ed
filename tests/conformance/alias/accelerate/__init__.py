"""`import accelerate` resolves to notebook_accel: the conformance run's import alias.

Every `accelerate.X` is the very module `notebook_accel.X` (one module object, so the state singletons
are shared), except `accelerate.test_utils`, which is our own small helper package
(`accelerate_test_utils` beside this folder). accelerate itself is never installed where this runs.
"""

import importlib
import importlib.abc
import importlib.util
import sys

_HELPERS = "accelerate.test_utils"


def _target(fullname: str) -> str:
    if fullname == _HELPERS or fullname.startswith(_HELPERS + "."):
        return "accelerate_test_utils" + fullname[len(_HELPERS):]
    return "notebook_accel" + fullname[len("accelerate"):]


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("accelerate."):
            return None
        try:
            module = importlib.import_module(_target(fullname))
        except ModuleNotFoundError as error:
            if error.name == _target(fullname):
                return None  # accelerate has it and we do not: the import fails as it would
            raise
        return importlib.util.spec_from_loader(fullname, self, origin=getattr(module, "__file__", None))

    def create_module(self, spec):
        return importlib.import_module(_target(spec.name))

    def exec_module(self, module):
        pass  # already imported under its own name


sys.meta_path.insert(0, _Alias())
import notebook_accel  # noqa: E402

sys.modules["accelerate"] = notebook_accel
