"""`notebook-accel env`: versions, hardware and the config in use, to paste into a bug report."""

from __future__ import annotations

import argparse
import json
import os
import platform

# Variables that change what a launch does; shown when set.
_RELEVANT_ENV = (
    "NOTEBOOK_ACCEL_CONFIG_FILE",
    "ACCELERATE_MIXED_PRECISION",
    "ACCELERATE_USE_CPU",
    "ACCELERATE_DEBUG_MODE",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
)


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--config_file", default=None, help="the config to show (default: the one launches use)")


def config_section(config_file=None) -> dict:
    """{'path', 'exists', 'config' (dict) or 'error' (str)} for the config launches would use."""
    from .. import config

    path = os.path.abspath(config_file) if config_file else config.default_config_file()
    out = {"path": path, "exists": os.path.isfile(path)}
    if out["exists"]:
        try:
            out["config"] = config.load_config(path).to_dict()
        except config.ConfigError as exc:
            out["error"] = str(exc)
    return out


def run(args: argparse.Namespace) -> int:
    from .. import hardware

    report = hardware.report()
    section = config_section(args.config_file)
    env = {k: os.environ[k] for k in _RELEVANT_ENV if k in os.environ}
    if args.json:
        data = report.to_dict()
        data.update(platform=platform.platform(), config=section, environment_variables=env)
        print(json.dumps(data, indent=2))
        return 0
    lines = [str(report), f"Platform: {platform.platform()}"]
    if env:
        lines.append("Environment variables:")
        lines += [f"  {k}={v}" for k, v in env.items()]
    if not section["exists"]:
        lines.append(f"Config: none ({section['path']} does not exist; `notebook-accel config` writes it)")
    elif "error" in section:
        lines.append(f"Config: {section['path']} is invalid: {section['error']}")
    else:
        lines.append(f"Config: {section['path']}")
        lines += [f"  {k}: {json.dumps(v)}" for k, v in section["config"].items()]
    print("\n".join(lines))
    return 0
