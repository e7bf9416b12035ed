"""big_model/'s shape: dependencies one way inside it, and accelerate's paths re-exporting it."""

import itertools

import pytest


def test_no_import_circle_inside_big_model():
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("notebook_accel", cache_dir=None)  # imports inside functions count too
    modules = sorted(m for m in graph.modules if m.startswith("notebook_accel.big_model."))
    assert "notebook_accel.big_model.pages" in modules
    circles = [
        (a, b)
        for a, b in itertools.combinations(modules, 2)
        if graph.find_shortest_chain(a, b) and graph.find_shortest_chain(b, a)
    ]
    assert circles == []
    # the floor's page handling knows nothing of what reads through it
    assert not graph.find_modules_directly_imported_by("notebook_accel.big_model.pages")


def test_accelerates_paths_are_the_same_objects():
    from notebook_accel import big_modeling, hooks
    from notebook_accel.big_model import dispatch, loading, planner, store
    from notebook_accel.big_model import hooks as big_hooks
    from notebook_accel.utils import modeling, offload

    assert big_modeling.dispatch_model is dispatch.dispatch_model
    assert hooks.AlignDevicesHook is big_hooks.AlignDevicesHook
    assert modeling.infer_auto_device_map is planner.infer_auto_device_map
    assert modeling.load_checkpoint_in_model is loading.load_checkpoint_in_model
    assert offload.OffloadedWeightsLoader is store.OffloadedWeightsLoader
