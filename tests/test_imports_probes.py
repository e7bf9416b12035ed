"""The `is_*_available` probes answer from what is installed here: a module found *and* its
distribution installed, at the version accelerate requires; nothing is hard-coded."""

import importlib
import importlib.util
import os

import pytest
import torch

from notebook_accel.utils import imports


def _fake_package(root, module, distribution=None, version="1.0.0"):
    """A package `module` under `root`, with a dist-info for `distribution` unless None."""
    (root / module).mkdir()
    (root / module / "__init__.py").write_text("")
    if distribution is not None:
        info = root / f"{distribution.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))

    def refresh():
        importlib.invalidate_caches()
        imports._has.cache_clear()

    refresh()
    yield tmp_path, refresh
    imports._has.cache_clear()
    importlib.invalidate_caches()


def test_a_probe_follows_what_is_installed(site):
    root, refresh = site
    if importlib.util.find_spec("timm") is not None:
        pytest.skip("timm is really installed here")
    assert imports.is_timm_available() is False
    _fake_package(root, "timm", "timm", "0.9.0")
    refresh()
    assert imports.is_timm_available() is True


def test_a_folder_named_like_a_package_is_not_the_package(site):
    root, refresh = site
    if importlib.util.find_spec("peft") is not None:
        pytest.skip("peft is really installed here")
    _fake_package(root, "peft", distribution=None)
    refresh()
    assert importlib.util.find_spec("peft") is not None
    assert imports.is_peft_available() is False


@pytest.mark.parametrize("version, stateful", [("0.7.1", False), ("0.8.0", True), ("0.10.0", True)])
def test_minimum_versions_are_compared(site, version, stateful):
    root, refresh = site
    if importlib.util.find_spec("torchdata") is not None:
        pytest.skip("torchdata is really installed here")
    _fake_package(root, "torchdata", "torchdata", version)
    refresh()
    assert imports.is_torchdata_available() is True
    assert imports.is_torchdata_stateful_dataloader_available() is stateful


@pytest.mark.parametrize("version, four, eight", [("0.38.0", False, True), ("0.39.0", True, True), ("0.37.0", False, False)])
def test_bitsandbytes_probes_read_its_version(site, version, four, eight):
    root, refresh = site
    if importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("bitsandbytes is really installed here")
    _fake_package(root, "bitsandbytes", "bitsandbytes", version)
    refresh()
    assert imports.is_bnb_available() is True
    assert imports.is_bnb_available(min_version="0.40") is False
    assert imports.is_4bit_bnb_available() is four
    assert imports.is_8bit_bnb_available() is eight


def test_installed_packages_read_true_and_match_find_spec():
    # The dev venv has these; the probe must agree with the import system.
    for probe, module in [
        (imports.is_pytest_available, "pytest"),
        (imports.is_matplotlib_available, "matplotlib"),
        (imports.is_tqdm_available, "tqdm"),
    ]:
        assert probe() is (importlib.util.find_spec(module) is not None), module


def test_rich_needs_the_package_and_the_flag(site, monkeypatch):
    root, refresh = site
    if importlib.util.find_spec("rich") is None:
        _fake_package(root, "rich", "rich", "13.0.0")
        refresh()
    monkeypatch.delenv("ACCELERATE_ENABLE_RICH", raising=False)
    assert imports.is_rich_available() is False
    monkeypatch.setenv("ACCELERATE_ENABLE_RICH", "1")
    assert imports.is_rich_available() is True


def test_megatron_needs_the_flag_first(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_MEGATRON_LM", "0")
    assert imports.is_megatron_lm_available() is False


def test_torch_feature_probes_follow_this_torch():
    major_minor = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert imports.is_weights_only_available() is (major_minor >= (2, 4))
    assert imports.is_pippy_available() is (importlib.util.find_spec("torch.distributed.pipelining") is not None)
    assert imports.is_rocm_available() is (torch.version.hip is not None and imports._fork_safe_cuda_count() > 0)
    xccl = getattr(torch.distributed.distributed_c10d, "is_xccl_available", None)
    assert imports.is_xccl_available() is bool(xccl and xccl())


def test_without_an_hpu_fp16_is_available_and_this_is_not_a_gaudi1():
    if imports.is_hpu_available():
        pytest.skip("an HPU is here")
    assert imports.is_habana_gaudi1() is False
    assert imports.is_fp16_available() is True


def test_every_probe_returns_a_bool_and_leaves_cuda_uninitialised():
    for name in imports.__all__:
        if name in ("is_transformer_engine_mxfp8_available", "is_bitsandbytes_multi_backend_available"):
            continue  # they import their package when it is present
        assert isinstance(getattr(imports, name)(), bool), name
    assert not torch.cuda.is_initialized()
    assert os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") in (None, "1")
