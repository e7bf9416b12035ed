"""`import accelerate` resolves to notebook_accel: the conformance run's import alias.

Every `accelerate.X` is the very module `notebook_accel.X` (one module object, so the state singletons
are shared), except `accelerate.test_utils`. For the distributed scripts that is our own small helper
package (`accelerate_test_utils` beside this folder); for the unit tests (units.py) it is accelerate's
real `test_utils`, unchanged from the downloaded wheel, named by NOTEBOOK_ACCEL_REAL_TEST_UTILS (the
wheel's `accelerate/` folder): its relative imports then reach notebook_accel through this alias.
accelerate itself is never installed where this runs.
"""

import importlib
import importlib.abc
import importlib.util
import os
import sys

_HELPERS = "accelerate.test_utils"
_REAL = os.environ.get("NOTEBOOK_ACCEL_REAL_TEST_UTILS")


def _target(fullname: str) -> str:
    if fullname == _HELPERS or fullname.startswith(_HELPERS + "."):
        return "accelerate_test_utils" + fullname[len(_HELPERS):]
    return "notebook_accel" + fullname[len("accelerate"):]


def _real_spec(fullname: str):
    """accelerate's own file for `fullname` (a module of its test_utils) from the wheel."""
    base = os.path.join(_REAL, *fullname.split(".")[1:])
    if os.path.isdir(base):
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(base, "__init__.py"), submodule_search_locations=[base])
    if os.path.exists(base + ".py"):
        return importlib.util.spec_from_file_location(fullname, base + ".py")
    return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("accelerate."):
            return None
        if _REAL and (fullname == _HELPERS or fullname.startswith(_HELPERS + ".")):
            return _real_spec(fullname)
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
