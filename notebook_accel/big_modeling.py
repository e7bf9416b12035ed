"""accelerate's `big_modeling` path: run models larger than the memory you give them. The code lives
in `notebook_accel/big_model/` (`dispatch.py` and what it builds on); this module only re-exports it."""

from __future__ import annotations

# Re-exports; the public names are listed once, in dispatch.py's __all__.
from .big_model.dispatch import (  # noqa: F401  (the private name: tests/test_big_modeling.py)
    __all__,
    _refuse_recurrent_layers_under_sequence_parallelism,
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    init_empty_weights,
    init_on_device,
    load_checkpoint_and_dispatch,
)
from .big_model.layerwise_casting import attach_layerwise_casting_hooks  # noqa: F401
