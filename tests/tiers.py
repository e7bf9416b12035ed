"""The suite's tiers, by test file: `pytest -m unit` (no process, no kernel: seconds), `process` (real
ranks, sessions, CLIs: the default for a file not named here), `kernel` (a real Jupyter kernel) and
`browser` (JupyterLab or Notebook 7 in headless Chromium) and `ray` (a real Ray cluster of several
nodes on this machine, run after the parallel part, alone). conftest.py marks each test with its file's
tier, and a unit-tier test that starts a process fails, so the list cannot drift from the truth.
`make test-fast` runs the unit tier and a named smoke set; `make test` runs them all."""

UNIT = {
    "test_constants", "test_environment", "test_families", "test_hooks", "test_imports_probes",
    "test_launch_plan", "test_layerwise_casting", "test_memory", "test_notebook_platforms", "test_offload",
    "test_precision", "test_prefetch_room", "test_public_surface", "test_ray_plan", "test_stall_report",
    "test_surface_helpers",
}  # fmt: skip
KERNEL = {
    "test_big_model_notebook", "test_cuda_origin", "test_docs_examples", "test_extension_comm", "test_gpu_ids",
    "test_hardware", "test_launch_pdb", "test_launcher_notebook", "test_magics", "test_magics_control",
    "test_notebook_cell_magic", "test_notebook_checkpoint", "test_notebook_fsdp", "test_notebook_hardware_and_logs",
    "test_notebook_multi_node", "test_notebook_precision", "test_output_bounds", "test_panel_transcript",
    "test_prewarm", "test_quickstart_notebook", "test_session_debug", "test_session_magics", "test_stall_settings",
}  # fmt: skip
BROWSER = {"test_browser_extension", "test_browser_notebook7", "test_browser_panels", "test_browser_smoke"}
RAY = {"test_ray_engine"}  # a Ray cluster (head and nodes: many processes): never beside other tests
NAMES = ("unit", "process", "kernel", "browser", "ray")


def tier(module: str) -> str:
    """The tier of a test file, by its module name (`test_launcher`)."""
    if module in UNIT:
        return "unit"
    if module in KERNEL:
        return "kernel"
    if module in BROWSER:
        return "browser"
    if module in RAY:
        return "ray"
    return "process"
