"""The YAML launch config: one dataclass, read / validate / write.

Keys and meanings are accelerate's (`default_config.yaml`), so a file written by `accelerate config`
is read as is. As there, `num_processes` counts processes on all machines together. Every problem
raises `ConfigError` naming the file, the key and the reason.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Optional

from .utils import families
from .utils.dataclasses import DistributedType
from .utils.fsdp_plugin import USE_FSDP_ENV, launch_variables

CONFIG_ENV = "NOTEBOOK_ACCEL_CONFIG_FILE"
MIXED_PRECISIONS = ("no", "fp16", "bf16", "fp8")
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
DISTRIBUTED_TYPES = tuple(t.value for t in DistributedType)
UNSUPPORTED_TYPES = ("DEEPSPEED", "MEGATRON_LM")
# distributed_type for N > 1 processes of each device family (hardware.detect_device_family()).
FAMILY_TYPES = {
    None: "MULTI_CPU",
    **{f.name: f.distributed_type.value for f in families.FAMILIES if f.distributed_type is not None},
}

_INT, _STR, _BOOL, _DICT, _LIST = (int,), (str,), (bool,), (dict,), (list,)
RAY_KEYS = ("engine", "ray_address", "resources_per_rank", "placement")
RAY_PLACEMENTS = ("pack", "spread", "strict_pack", "strict_spread")
# Keys accelerate writes that a launch here does not act on: type-checked, kept, written back.
_KEPT = {
    "same_network": _BOOL,
    "main_training_function": _STR,
    "enable_cpu_affinity": _BOOL,
    "downcast_bf16": (bool, str),
    "fp8_config": _DICT,
    "deepspeed_config": _DICT,
    "fsdp_config": _DICT,
    "tp_config": _DICT,
    "parallelism_config": _DICT,
    "megatron_lm_config": _DICT,
    "ipex_config": _DICT,
    "mpirun_config": _DICT,
    "dynamo_config": _DICT,
    "tpu_name": _STR,
    "tpu_zone": _STR,
    "tpu_use_cluster": _BOOL,
    "tpu_use_sudo": _BOOL,
    "command_file": _STR,
    "commands": _LIST,
    "tpu_vm": _LIST,
    "tpu_env": _LIST,
    "fp16": _BOOL,
    "dynamo_backend": _STR,
}
_TYPE_NAMES = {int: "an integer", str: "a string", bool: "true or false", dict: "a mapping", list: "a list"}
_SECONDS = (int, float)


class ConfigError(ValueError):
    """A config file that cannot be used; names the file, the key and the reason."""

    def __init__(self, path, key: Optional[str], reason: str):
        self.path, self.key, self.reason = path, key, reason
        where = f"{path}: key {key!r}" if key else f"{path}"
        super().__init__(f"config file {where}: {reason}")


@dataclass
class ClusterConfig:
    """One machine's part of a launch, as accelerate's `ClusterConfig` stores it."""

    compute_environment: str = "LOCAL_MACHINE"
    distributed_type: Optional[str] = None  # None: decided by the hardware at launch time
    mixed_precision: str = "no"
    use_cpu: bool = False
    debug: bool = False
    num_processes: Optional[int] = None  # on all machines together; None: decided at launch time
    num_machines: int = 1
    machine_rank: int = 0
    gpu_ids: Optional[str] = None  # "all" or "0,1,3"
    main_process_ip: Optional[str] = None
    main_process_port: Optional[int] = None
    rdzv_backend: str = "static"
    max_restarts: int = 0  # ours, not accelerate's: written only when set, so accelerate can read the file
    stall_after: Optional[float] = None  # ours too (the stall watch's seconds, 0: off); None: not set
    engine: Optional[str] = None  # ours: "ray" runs launches' ranks as Ray actors; None: as the arguments say
    ray_address: Optional[str] = None  # ours, with engine: ray (as the launch arguments of those names)
    resources_per_rank: Optional[dict] = None
    placement: Optional[str] = None
    extra: dict = field(default_factory=dict)  # accelerate keys kept as read (see _KEPT)
    path: Optional[str] = field(default=None, compare=False)

    # -- reading ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data, path="<dict>") -> "ClusterConfig":
        if not isinstance(data, dict):
            raise ConfigError(path, None, f"must be a mapping of keys to values, not {type(data).__name__}")
        data = dict(data)
        unknown = sorted(str(k) for k in data if k not in _FIELD_TYPES and k not in _KEPT)
        if unknown:
            raise ConfigError(
                path,
                unknown[0],
                f"unknown key (known keys: {', '.join(sorted(_FIELD_TYPES))}, "
                "and accelerate's keys for other launchers)",
            )
        values = {}
        for key, value in data.items():
            types = _FIELD_TYPES.get(key) or _KEPT[key]
            value = _coerce(key, value)
            if value is not None and (
                not isinstance(value, types) or (bool not in types and isinstance(value, bool))
            ):
                if types is _SECONDS:
                    wanted = "a number of seconds (0 turns the stall watch off)"
                else:
                    wanted = " or ".join(_TYPE_NAMES[t] for t in types)
                raise ConfigError(path, key, f"must be {wanted}, not {type(value).__name__} {value!r}")
            values[key] = value
        if values.get("mixed_precision") is None and values.get("fp16"):  # accelerate's older spelling
            values["mixed_precision"] = "fp16"
        extra = {k: values.pop(k) for k in list(values) if k in _KEPT}
        fields = {k: v for k, v in values.items() if v is not None or k in _NULLABLE}
        config = cls(**fields, extra=extra, path=str(path))
        config.validate()
        return config

    def validate(self) -> None:
        """Checks each value and the combinations; raises ConfigError on the first problem."""
        path = self.path or "<config>"

        def fail(key, reason):
            raise ConfigError(path, key, reason)

        if self.compute_environment != "LOCAL_MACHINE":
            fail(
                "compute_environment", f"{self.compute_environment!r} is not supported; only LOCAL_MACHINE is"
            )
        if self.distributed_type is not None:
            if self.distributed_type not in DISTRIBUTED_TYPES:
                fail(
                    "distributed_type",
                    f"{self.distributed_type!r} is not one of {', '.join(DISTRIBUTED_TYPES)}",
                )
            if self.distributed_type in UNSUPPORTED_TYPES:
                fail(
                    "distributed_type",
                    f"{self.distributed_type} is not implemented by notebook_accel; use FSDP "
                    "(sharded data parallel), MULTI_GPU (data parallel) or MULTI_CPU",
                )
        if self.mixed_precision not in MIXED_PRECISIONS:
            fail("mixed_precision", f"{self.mixed_precision!r} is not one of {', '.join(MIXED_PRECISIONS)}")
        if self.rdzv_backend not in RDZV_BACKENDS:
            fail("rdzv_backend", f"{self.rdzv_backend!r} is not one of {', '.join(RDZV_BACKENDS)}")
        if self.num_machines < 1:
            fail("num_machines", f"{self.num_machines} must be 1 or more")
        if not 0 <= self.machine_rank < self.num_machines:
            fail(
                "machine_rank",
                f"{self.machine_rank} must be in 0..{self.num_machines - 1} "
                f"since num_machines is {self.num_machines}",
            )
        if self.max_restarts < 0:
            fail("max_restarts", f"{self.max_restarts} must be 0 or more")
        stall = self.stall_after
        if stall is not None and (
            isinstance(stall, bool) or not isinstance(stall, _SECONDS) or not math.isfinite(stall) or stall < 0
        ):
            fail("stall_after", f"{stall!r} must be a number of seconds, 0 or more (0 turns the stall watch off)")
        self._validate_ray(fail)
        if self.main_process_port is not None and not 1 <= self.main_process_port <= 65535:
            fail("main_process_port", f"{self.main_process_port} is outside 1..65535")
        if self.num_machines > 1 and not self.main_process_ip:
            fail(
                "main_process_ip",
                f"num_machines is {self.num_machines}, so every machine needs the address "
                "of the machine with machine_rank 0",
            )
        n = self.num_processes
        if n is not None:
            if n < 1:
                fail("num_processes", f"{n} must be 1 or more (the total over all machines)")
            if n % self.num_machines:
                fail(
                    "num_processes",
                    f"{n} processes cannot be split evenly over num_machines="
                    f"{self.num_machines} (num_processes counts all machines together)",
                )
        if self.distributed_type == "NO" and ((n or 1) > 1 or self.num_machines > 1):
            fail(
                "distributed_type",
                f"NO runs a single process, but num_processes is {n} and num_machines "
                f"is {self.num_machines}; use MULTI_CPU or MULTI_GPU",
            )
        if self.use_cpu and self.distributed_type not in (None, "NO", "MULTI_CPU", "FSDP"):
            fail(
                "use_cpu",
                f"true contradicts distributed_type {self.distributed_type}; set use_cpu: false "
                "or distributed_type: MULTI_CPU",
            )
        fsdp = self.extra.get("fsdp_config") or {}
        strangers = sorted(k for k in fsdp if not str(k).startswith("fsdp_"))
        if strangers:
            fail("fsdp_config", f"has keys {strangers}; its keys are accelerate's fsdp_* names (e.g. fsdp_version)")
        try:
            launch_variables(fsdp, strict=False)  # values checked here, not later in every rank
        except ValueError as exc:
            fail("fsdp_config", str(exc))
        ids = self.device_ids
        if ids is not None and n is not None and not self.cpu and n // self.num_machines > len(ids):
            fail(
                "gpu_ids",
                f"{self.gpu_ids!r} lists {len(ids)} device(s) but each machine runs "
                f"{n // self.num_machines} processes",
            )

    def _validate_ray(self, fail) -> None:
        """engine: ray's keys (their values' finer rules are the launch's: launch/ray_plan.py)."""
        if self.engine not in (None, "ray"):
            why = "write ray, or leave it out (this machine, or torch elastic across machines, as the keys say)"
            fail("engine", f"{self.engine!r} is not an engine here: {why}")
        if self.engine != "ray":
            for key in RAY_KEYS[1:]:
                if getattr(self, key) is not None:
                    fail(key, "only applies with engine: ray: add it, or remove this key")
            return
        if self.placement is not None and self.placement not in RAY_PLACEMENTS:
            fail("placement", f"{self.placement!r} is not one of {', '.join(RAY_PLACEMENTS)}")
        placing = {
            "num_machines": self.num_machines != 1,
            "machine_rank": self.machine_rank != 0,
            "main_process_ip": self.main_process_ip is not None,
            "main_process_port": self.main_process_port is not None,
            "rdzv_backend": self.rdzv_backend != "static",
            "max_restarts": self.max_restarts != 0,
            "gpu_ids": self.gpu_ids not in (None, "all"),
        }
        for key, set_here in placing.items():
            if set_here:
                fail(key, "engine: ray places the ranks on the cluster itself: remove this key")

    # -- what a launch uses ----------------------------------------------------------------
    @property
    def cpu(self) -> bool:
        return bool(self.use_cpu) or self.distributed_type == "MULTI_CPU"

    @property
    def processes_per_machine(self) -> Optional[int]:
        return None if self.num_processes is None else self.num_processes // self.num_machines

    @property
    def device_ids(self) -> Optional[list]:
        """The listed device indices, or None for all devices."""
        if self.gpu_ids is None or str(self.gpu_ids).strip().lower() == "all":
            return None
        try:
            ids = [int(part) for part in str(self.gpu_ids).split(",") if part.strip()]
        except ValueError:
            raise ConfigError(
                self.path or "<config>",
                "gpu_ids",
                f"{self.gpu_ids!r} must be 'all' or device indices like '0,1'",
            ) from None
        if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
            raise ConfigError(
                self.path or "<config>", "gpu_ids", f"{self.gpu_ids!r} must list distinct indices >= 0"
            )
        return ids

    def launch_defaults(self) -> dict:
        """make_plan's argument name -> the value this file gives it (only what the file sets)."""
        out = {
            "mixed_precision": self.mixed_precision,
            "cpu": self.cpu,
            "num_nodes": self.num_machines,
            "node_rank": self.machine_rank,
            "rdzv_backend": self.rdzv_backend,
            "max_restarts": self.max_restarts,
            "debug": self.debug,
        }
        optional = {
            "num_processes": self.processes_per_machine,
            "master_addr": self.main_process_ip,
            "use_port": self.main_process_port,
            "gpu_ids": None if self.device_ids is None else ",".join(map(str, self.device_ids)),
        }
        out.update({k: v for k, v in optional.items() if v is not None})
        return out

    def launch_env(self) -> dict:
        """The variables accelerate's launcher sets for this file: FSDP's switch and settings."""
        if self.distributed_type != "FSDP":
            return {}
        settings = launch_variables(self.extra.get("fsdp_config") or {}, strict=False)  # checked by validate
        return {USE_FSDP_ENV: "true", **settings}

    # -- writing ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("extra", "path")
        }
        for key in ("distributed_type", "num_processes", "gpu_ids", "stall_after", *RAY_KEYS):
            if out[key] is None:
                del out[key]
        if not self.max_restarts:
            del out["max_restarts"]
        out.update(self.extra)
        return dict(sorted(out.items()))

    def save(self, path) -> str:
        """Validates, then writes YAML atomically (a reader never sees half a file); returns the path."""
        import yaml

        path = os.path.abspath(os.path.expanduser(str(path)))
        self.path = path
        self.validate()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".config-", suffix=".yaml", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                yaml.safe_dump(self.to_dict(), f, default_flow_style=False)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        return path


_FIELD_TYPES = {
    "compute_environment": _STR,
    "distributed_type": _STR,
    "mixed_precision": _STR,
    "use_cpu": _BOOL,
    "debug": _BOOL,
    "num_processes": _INT,
    "num_machines": _INT,
    "machine_rank": _INT,
    "gpu_ids": (str, int),
    "main_process_ip": _STR,
    "main_process_port": _INT,
    "rdzv_backend": _STR,
    "max_restarts": _INT,
    "stall_after": _SECONDS,
    "engine": _STR,
    "ray_address": _STR,
    "resources_per_rank": _DICT,
    "placement": _STR,
}
_NULLABLE = ("distributed_type", "num_processes", "gpu_ids", "main_process_ip", "main_process_port")


def _coerce(key: str, value):
    """The few spellings accelerate and YAML produce that are not the field's own type."""
    if key in ("mixed_precision", "downcast_bf16") and value is False:
        return "no"  # YAML 1.1 reads a bare `no` as false
    if key == "distributed_type" and value is False:
        return "NO"  # and a bare `NO` too
    if key == "num_processes" and value == -1:
        return None  # accelerate's "not set"
    if key == "gpu_ids" and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # YAML reads `gpu_ids: 0` as an integer
    if key == "rdzv_backend" and value is None:
        return "static"
    return value


# -- files -------------------------------------------------------------------------------------


def default_config_file() -> str:
    """$NOTEBOOK_ACCEL_CONFIG_FILE, else ~/.cache/notebook_accel/default_config.yaml."""
    env = os.environ.get(CONFIG_ENV)
    if env:
        return os.path.abspath(os.path.expanduser(env))
    return os.path.join(os.path.expanduser("~"), ".cache", "notebook_accel", "default_config.yaml")


def load_config(path) -> ClusterConfig:
    """Reads and validates one file (YAML, or JSON which YAML also reads)."""
    import yaml

    path = os.path.abspath(os.path.expanduser(str(path)))
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(path, None, "no such file; write one with `notebook-accel config`") from None
    except OSError as exc:
        raise ConfigError(path, None, f"cannot be read: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(path, None, f"is not valid YAML: {exc}") from None
    if data is None:
        data = {}  # an empty file: every default
    return ClusterConfig.from_dict(data, path)


def load_default() -> Optional[ClusterConfig]:
    """The config in use: the default file if it exists, else None. A broken file raises."""
    path = default_config_file()
    return load_config(path) if os.path.isfile(path) else None
