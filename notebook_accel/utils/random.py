"""accelerate's path for seeding and RNG synchronisation (`notebook_accel.utils.random`).

They ask the process's PartialState, so they live above state.py, in rng.py.
"""

from __future__ import annotations

from ..rng import (  # noqa: F401  (accelerate's names at accelerate's path)
    capture_rng_states,
    restore_rng_states,
    set_seed,
    synchronize_rng_state,
    synchronize_rng_states,
)
