"""notebook_accel: run one PyTorch training loop on 1..N processes, from a notebook or a script.

Public names follow Hugging Face accelerate. They load lazily, so `import notebook_accel` is cheap
and never imports IPython or ipywidgets (a worker process or a plain script has neither).
"""

from __future__ import annotations

import sys

from .launch import rank_imports as _rank_imports
from .utils import cuda_init as _cuda_init
from .utils.lazy import lazy_exports
from .utils.version import __version__

_EXPORTS = {
    "PartialState": "state",
    "AcceleratorState": "state",
    "GradientState": "state",
    "DistributedType": "utils.dataclasses",
    "DataLoaderConfiguration": "utils.dataclasses",
    "DDPCommunicationHookType": "utils.dataclasses",
    "DistributedDataParallelKwargs": "utils.dataclasses",
    "GradScalerKwargs": "utils.dataclasses",
    "InitProcessGroupKwargs": "utils.dataclasses",
    "AutocastKwargs": "utils.dataclasses",
    "GradientAccumulationPlugin": "utils.dataclasses",
    "ProjectConfiguration": "utils.dataclasses",
    "FullyShardedDataParallelPlugin": "utils.dataclasses",
    "skip_first_batches": "data_loader",
    "prepare_data_loader": "data_loader",
    "find_executable_batch_size": "utils.memory",
    "synchronize_rng_states": "utils.random",
    "notebook_launcher": "launch",
    "debug_launcher": "launch",
    "Accelerator": "accelerator",
    "init_empty_weights": "big_modeling",
    "init_on_device": "big_modeling",
    "cpu_offload": "big_modeling",
    "cpu_offload_with_hook": "big_modeling",
    "disk_offload": "big_modeling",
    "dispatch_model": "big_modeling",
    "load_checkpoint_and_dispatch": "big_modeling",
    "infer_auto_device_map": "utils.modeling",
    "load_ipython_extension": "jupyter",
    "unload_ipython_extension": "jupyter",
    "hardware_widget": "jupyter",
}
# accelerate's other top-level names (the public-surface test lists them).
_EXPORTS.update(
    {
        "ProfileKwargs": "utils.dataclasses",
        "is_rich_available": "utils.imports",
        "load_checkpoint_in_model": "utils.modeling",
    }
)

__all__ = sorted(_EXPORTS) + ["__version__"]


__getattr__ = lazy_exports(globals(), _EXPORTS)


# What a typical training function's ranks import: a fork launch imports them in the parent once
# (launch/rank_imports.py), so forked ranks inherit them instead of each paying ~1.7 s every launch.
_rank_imports.lend(
    (
        "notebook_accel.accelerator",
        "notebook_accel.data_loader",
        "notebook_accel.optimizer",
        "notebook_accel.scheduler",
        "notebook_accel.checkpointing",
    )
)
# From here on, the line that first initialises CUDA is recorded: a refused fork launch names it.
_cuda_init.install()

if "ipykernel" in sys.modules:  # in a kernel: launches get the live panel and `Cell In[N]` labels
    from .jupyter import prewarm, register_frontend

    register_frontend()
    prewarm()  # and a forkserver, booting in the background for the first launch


def _jupyter_labextension_paths():
    """Where the prebuilt JupyterLab extension lives in this package (for `jupyter labextension`)."""
    return [{"src": "labextension", "dest": "notebook-accel-labextension"}]


def __dir__():
    return __all__
