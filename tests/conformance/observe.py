"""Runs one of accelerate's test scripts unchanged in this process and records its test calls.

    python observe.py SCRIPT.py REPORT_DIR

The script's source is executed as `__main__` in a namespace that wraps each test function as the
script defines it (`test_*`, `check_*`, `*_check`), so a call made by the script's own `main()` is
recorded as passed or failed. Calls a test makes to another (helpers such as
`check_model_parameters`) are not counted. CONFORMANCE_SKIP names checks not to run (see run.py). The report is REPORT_DIR/rank<RANK>.json.
"""

import functools
import json
import os
import sys
import time
import traceback


def _is_test(name: str, value) -> bool:
    return callable(value) and getattr(value, "__code__", None) is not None and (
        name.startswith(("test_", "check_")) or name.endswith("_check")
    )


class _Recorder:
    def __init__(self, skip=()):
        self.calls, self.depth, self.skip = [], 0, set(skip)

    def wrap(self, name, function):
        if name in self.skip:
            return self.skipped(name)
        @functools.wraps(function)
        def observed(*args, **kwargs):
            outer = self.depth == 0
            self.depth += 1
            started = time.monotonic()
            try:
                result = function(*args, **kwargs)
            except BaseException as error:
                if outer:
                    self.calls.append({"name": name, "ok": False, "seconds": time.monotonic() - started,
                                       "error": "".join(traceback.format_exception(error))[-4000:]})
                raise
            finally:
                self.depth -= 1
            if outer:
                self.calls.append({"name": name, "ok": True, "seconds": time.monotonic() - started})
            return result

        return observed

    def skipped(self, name):
        # Only for a check that fails in accelerate itself on this many ranks (run.py's UPSTREAM list,
        # which proves that failure in a separate run first): the rest of the script still runs.
        def not_run(*args, **kwargs):
            if self.depth == 0:
                self.calls.append({"name": name, "ok": None, "seconds": 0.0})

        return not_run


class _Namespace(dict):
    """Module globals that wrap test functions as the script stores them (STORE_NAME goes through
    __setitem__ when the globals are not an exact dict)."""

    def __init__(self, recorder, **items):
        super().__init__(**items)
        self.recorder = recorder

    def __setitem__(self, name, value):
        if _is_test(name, value):
            value = self.recorder.wrap(name, value)
        super().__setitem__(name, value)


def main(script: str, report_dir: str) -> int:
    recorder = _Recorder(skip=[n for n in os.environ.get("CONFORMANCE_SKIP", "").split(",") if n])
    namespace = _Namespace(recorder, __name__="__main__", __file__=script, __builtins__=__builtins__)
    sys.argv = [script]
    sys.path[0] = os.path.dirname(script)
    finished, code = False, 0
    try:
        with open(script) as f:
            exec(compile(f.read(), script, "exec"), namespace)
        finished = True
    except SystemExit as stop:
        finished, code = stop.code in (None, 0), stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        rank = os.environ.get("RANK", "0")
        with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": int(rank), "finished": finished, "calls": recorder.calls}, f)
    return code


if __name__ == "__main__":
    sys.exit(main(os.path.abspath(sys.argv[1]), sys.argv[2]))
