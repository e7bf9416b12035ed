"""One table of device families (notebook_accel/utils/families.py): nobody else writes a list of them."""

import ast
import pathlib

import pytest

from notebook_accel.utils import families
from notebook_accel.utils.dataclasses import DistributedType

PACKAGE = pathlib.Path(families.__file__).resolve().parents[1]
TABLE = pathlib.Path(families.__file__).resolve()
NAMES = {"cuda", "xpu", "npu", "mlu", "musa", "sdaa", "hpu", "mps", "neuron", "xla"}
# Not ours to edit in this change (launch/plan.py belongs to the launch work); remove when it reads the table.
KNOWN = set()  # (file, literal) pairs allowed to list families; none today


def _family_lists(tree):
    """(line, source) of each tuple/list/set literal or dict with two or more family names."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        found = {i.value for i in items if isinstance(i, ast.Constant) and i.value in NAMES}
        if len(found) >= 2:
            yield node


def test_no_module_but_the_table_lists_families():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.resolve() == TABLE:
            continue
        source = path.read_text(encoding="utf-8")
        for node in _family_lists(ast.parse(source)):
            rel = path.relative_to(PACKAGE).as_posix()
            if (rel, ast.get_source_segment(source, node)) in KNOWN:
                continue
            offenders.append(f"{rel}:{node.lineno}: {ast.get_source_segment(source, node)[:80]}")
    assert not offenders, "read notebook_accel.utils.families instead of listing families:\n" + "\n".join(offenders)


def test_the_scan_finds_a_list():
    tree = ast.parse('KINDS = ("cuda", "xpu")\nVISIBLE = {"npu": "A", "mlu": "B"}\nONE = ("cuda", "cpu")')
    assert [n.lineno for n in _family_lists(tree)] == [1, 2]


def test_table_lookup():
    assert families.names()[0] == "xla" and set(families.names()) == NAMES
    cuda = families.family("cuda")
    assert (cuda.distributed_type, cuda.backend, cuda.visible_env) == (
        DistributedType.MULTI_GPU,
        "nccl",
        "CUDA_VISIBLE_DEVICES",
    )
    assert families.family("mps").distributed_type is None and families.family("mps").own_rng
    with pytest.raises(ValueError, match="Unknown device family 'tpu'"):
        families.family("tpu")


def test_detect_on_this_machine_never_raises():
    assert families.detect() in (None, *families.names())
