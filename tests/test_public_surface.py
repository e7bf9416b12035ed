"""accelerate 1.15.0's public surface, measured: every public name (read from its wheel with `ast`)
exists at the same path in notebook_accel, or is on the one list of names we do not provide
(tests/conformance/not_provided.py), each with its reason."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import compat_section  # noqa: E402
from conformance import not_provided, surface  # noqa: E402
from conformance.surface import resolve  # noqa: E402


@pytest.fixture(scope="module")
def accelerate_names() -> set:
    return surface.public_names()


def test_the_reader_finds_accelerates_own_names_and_not_its_imports(accelerate_names):
    for name in (
        "Accelerator",
        "notebook_launcher",
        "utils.gather",
        "utils.is_cuda_available",
        "utils.operations.gather",
        "utils.memory.find_executable_batch_size",
        "local_sgd.LocalSGD",
        "accelerator.Accelerator.profile",
        "accelerator.Accelerator.prepare",
        "state.PartialState.split_between_processes",
        "state.GradientState.end_of_dataloader",
    ):
        assert name in accelerate_names, name
    # utils/operations.py imports torch, and accelerate's modules import each other's names: not theirs.
    for name in ("utils.operations.torch", "utils.operations.PartialState", "accelerator.os", "utils.os",
                 "accelerator.Accelerator._prepare_one", "utils._filter_args"):
        assert name not in accelerate_names, name
    assert len(accelerate_names) > 500


def test_every_public_name_is_provided_or_listed_with_a_reason(accelerate_names):
    missing = sorted(
        n for n in accelerate_names if n not in not_provided.NOT_PROVIDED and not resolve(n)
    )
    assert not missing, (
        f"{len(missing)} of accelerate's public names are neither in notebook_accel nor on "
        f"tests/conformance/not_provided.py: {missing}"
    )


def test_no_name_on_the_list_is_actually_provided():
    stale = sorted(n for n in not_provided.NOT_PROVIDED if resolve(n))
    assert not stale, f"notebook_accel provides these, so take them off tests/conformance/not_provided.py: {stale}"


def test_every_name_on_the_lists_is_accelerates(accelerate_names):
    unknown = sorted(set(not_provided.NOT_PROVIDED) - accelerate_names)
    assert not unknown, f"not public names of accelerate {surface.wheel.VERSION}: {unknown}"


def test_every_listed_name_has_one_known_reason():
    seen = {}
    for key, (reason, names) in not_provided.GROUPS.items():
        assert reason.strip(), key
        for name in names:
            assert name not in seen, f"{name} is listed under {seen[name]!r} and {key!r}"
            seen[name] = key


def test_resolve_can_fail():
    assert resolve("utils.operations.gather")
    assert resolve("accelerator.Accelerator.profile")
    assert not resolve("utils.operations.no_such_name")
    assert not resolve("no_such_module.thing")
    assert not resolve("accelerator.Accelerator.no_such_method")


def test_the_compatibility_page_and_the_readme_headline_are_up_to_date():
    page = (ROOT / "docs" / "compatibility.md").read_text()
    assert compat_section.current(page) == compat_section.section(), (
        "docs/compatibility.md's public-surface section is out of date: run python tools/compat_section.py"
    )
    readme = (ROOT / "README.md").read_text()
    assert compat_section.current_headline(readme) == compat_section.headline(), (
        "README.md's compatibility headline is out of date: run python tools/compat_section.py"
    )
    names, provided = compat_section.measured()
    assert f"**{len(provided)} of {len(names)}**" in compat_section.headline()
    assert compat_section.main(["--check"]) == 0


def test_the_section_check_fails_on_a_stale_or_missing_section():
    fresh = compat_section.section()
    stale = fresh.replace("provides **", "provides **1", 1)
    assert compat_section.current(f"intro\n{stale}\noutro") != fresh
    with pytest.raises(ValueError, match="compat:start"):
        compat_section.current("a page without the markers")
    headline = compat_section.headline()
    assert compat_section.current_headline(f"a\n{headline.replace('**', '**1', 1)} b") != headline
    with pytest.raises(ValueError, match="compat:headline"):
        compat_section.current_headline("a README without the markers")
