"""A process started from a Jupyter kernel stops being part of it, before any user code runs.

A rank forked from a kernel inherits the kernel's IPython shell, its display hook, its input
forwarding, ipykernel's comm factory and the file descriptors of the kernel's own terminal. Left as
they are, `display()`, widgets (`tqdm.auto` picks ipywidgets when it sees a kernel) and `input()` try
to talk to the kernel's sockets from a second process, and ipykernel's fork check dumps every such
message as a warning on the kernel's own stderr (the Jupyter server's log), past the rank's output
capture. After `leave_the_kernel()` the process is a plain Python one: `get_ipython()` is None, so
`display(obj)` prints the object and `tqdm.auto` draws a text bar, all into the rank's fds 1 and 2.

IPython is never imported here: only what the kernel already imported (`sys.modules`) is touched.
"""

from __future__ import annotations

import builtins
import importlib
import os
import sys


def leave_the_kernel(kernel_streams: tuple = ()) -> None:
    """Make this process a plain Python one. `kernel_streams`: the (stdout, stderr) objects this
    process had before its fds 1 and 2 were taken over (ipykernel's OutStreams in a forked kernel);
    the kernel's own terminal, which they keep a descriptor of, is pointed at fds 1 and 2 too."""
    _redirect_kernel_terminal(kernel_streams)
    _drop_the_shell()
    if _from_the_kernel(sys.displayhook):
        sys.displayhook = sys.__displayhook__
    if _from_the_kernel(sys.excepthook):
        sys.excepthook = sys.__excepthook__
    _plain_input()
    _plain_comms()
    _text_progress_bars()


def _redirect_kernel_terminal(kernel_streams: tuple) -> None:
    # ipykernel keeps a copy of the kernel's real stdout/stderr (the server's log): its own logger
    # and the fd echo write there. In this process those writes belong to fds 1 and 2.
    for stream, fd in zip(kernel_streams, (1, 2)):
        copy = getattr(stream, "_original_stdstream_copy", None)
        if isinstance(copy, int) and copy > 2:
            try:
                os.dup2(fd, copy)
            except OSError:
                pass


def _from_the_kernel(hook) -> bool:
    # IPython's and ipykernel's hooks (a bound method of the shell, ipykernel's display hook); a
    # hook the user's own script installed before forking stays.
    owner = getattr(hook, "__self__", hook)
    module = getattr(type(owner), "__module__", "") or ""
    return module.split(".")[0] in ("IPython", "ipykernel")


def _drop_the_shell() -> None:
    module = sys.modules.get("IPython.core.interactiveshell")
    if module is not None and module.InteractiveShell.initialized():
        # clear_instance on the concrete class clears the singleton for all its parents too.
        type(module.InteractiveShell.instance()).clear_instance()


def _plain_input() -> None:
    # While a cell runs, ipykernel replaces input() and getpass() by requests to the front end;
    # from a rank they would go out on the kernel's sockets. Here stdin is /dev/null instead.
    kernel = getattr(builtins.input, "__self__", None)
    if kernel is None or not type(kernel).__module__.startswith("ipykernel"):
        return
    original = getattr(kernel, "_sys_raw_input", None)
    if callable(original):
        builtins.input = original
    getpass = sys.modules.get("getpass")
    saved = getattr(kernel, "_save_getpass", None)
    if getpass is not None and callable(saved):
        getpass.getpass = saved


def _plain_comms() -> None:
    # ipykernel makes `comm.create_comm` open comms through the kernel's session. Widgets made
    # in a rank get the comm package's own inert comms instead: they reach no one, quietly.
    comm = sys.modules.get("comm")
    if comm is None:
        return
    for public, default in (("create_comm", "_create_comm"), ("get_comm_manager", "_get_comm_manager")):
        if hasattr(comm, default):
            setattr(comm, public, getattr(comm, default))


def _text_progress_bars() -> None:
    # tqdm.autonotebook chooses widgets whenever `ipykernel.zmqshell` is imported, shell or not.
    sys.modules.pop("ipykernel.zmqshell", None)
    notebook = sys.modules.get("tqdm.notebook")
    if notebook is None:
        return
    # The kernel imported tqdm.auto already (transformers, datasets do), so its names are the widget
    # bars: choose again here and give the modules the text bars, so that `from tqdm.auto import
    # tqdm` and modules holding `tqdm.auto` (transformers' `tqdm_lib`) get text.
    names = ("tqdm.autonotebook", "tqdm.auto")
    old = {name: sys.modules.get(name) for name in names}
    if not any(m is not None and _is_widget_bar(getattr(m, "tqdm", None), notebook) for m in old.values()):
        return
    for name in names:
        sys.modules.pop(name, None)
    try:
        fresh = {name: importlib.import_module(name) for name in names}
    except Exception:
        fresh = None
    package = sys.modules.get("tqdm")
    for name, module in old.items():
        if module is None:
            continue
        sys.modules[name] = module
        if package is not None:
            setattr(package, name.rpartition(".")[2], module)
        if fresh is not None:
            for attribute in ("tqdm", "trange"):
                if hasattr(fresh[name], attribute):
                    setattr(module, attribute, getattr(fresh[name], attribute))


def _is_widget_bar(cls, notebook) -> bool:
    return isinstance(cls, type) and issubclass(cls, notebook.tqdm)
