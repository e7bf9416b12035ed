"""torch_xla.runtime's world_size() (how many ranks the replication has) and global_ordinal()
(this rank's index), as the stand-in's spawn sets them."""

import os
import threading

_here = threading.local()  # the ordinal of the device this thread runs


def world_size() -> int:
    return int(os.environ.get("STANDIN_XLA_DEVICES", "4"))


def global_ordinal() -> int:
    return _here.ordinal
