"""`notebook-accel merge-weights CHECKPOINT_DIR OUT`: a sharded FSDP model folder as one weights file.

The folder is one `save_state` wrote with SHARDED_STATE_DICT (`.../pytorch_model_fsdp_0`, a
torch.distributed.checkpoint folder); the merge runs here, in one process, on the CPU.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(p) -> None:
    p.add_argument("checkpoint_directory", help="the sharded model folder (it holds .metadata and *.distcp)")
    p.add_argument("output_path", help="the folder to write model.safetensors (or pytorch_model.bin) in")
    p.add_argument(
        "--unsafe_serialization",
        action="store_true",
        help="write pytorch_model.bin with torch.save instead of model.safetensors",
    )
    p.add_argument(
        "--remove_checkpoint_dir",
        action="store_true",
        help="delete the sharded folder once the merge is written",
    )


def _problem(source: str, out: str, remove: bool):
    """Why these paths cannot be merged, or None; checked before any file is read or written."""
    if not os.path.isdir(source):
        what = "is a file" if os.path.exists(source) else "does not exist"
        return (
            f"checkpoint directory {source} {what}; pass the sharded model folder save_state wrote "
            "(e.g. checkpoints/checkpoint_0/pytorch_model_fsdp_0)"
        )
    if os.path.exists(out) and not os.path.isdir(out):
        return f"output path {out} is a file; pass a folder (the merged weights are written inside it)"
    if remove:
        inside = os.path.commonpath([os.path.realpath(source), os.path.realpath(out)])
        if inside == os.path.realpath(source):
            return (
                f"output path {out} is inside {source}, which --remove_checkpoint_dir would delete with "
                "the merged file; write it elsewhere"
            )
    return None


def run(args: argparse.Namespace) -> int:
    source = os.path.abspath(os.path.expanduser(args.checkpoint_directory))
    out = os.path.abspath(os.path.expanduser(args.output_path))
    problem = _problem(source, out, args.remove_checkpoint_dir)
    if problem is None:
        from ..main_process import merge_fsdp_weights

        try:
            path = merge_fsdp_weights(
                source,
                out,
                safe_serialization=not args.unsafe_serialization,
                remove_checkpoint_dir=args.remove_checkpoint_dir,
            )
        except (ValueError, OSError) as exc:  # not a DCP folder, or one that cannot be read or written
            problem = str(exc).rstrip(".")
    if problem is not None:
        print(f"notebook-accel merge-weights: {problem}.", file=sys.stderr)
        return 1
    print(f"Merged weights saved to {path}")
    if args.remove_checkpoint_dir:
        print(f"Removed {source}")
    return 0
