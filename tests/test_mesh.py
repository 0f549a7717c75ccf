import numpy as np
import pytest

from llama_xla_helpers.mesh import hybrid_device_ids, make_mesh
from llama_xla_helpers.runtime import init_runtime


def test_runtime_gives_eight_cpu_devices(runtime):
    assert (runtime.device_kind, runtime.num_devices) == ("CPU", 8)
    assert (runtime.process_index, runtime.process_count) == (0, 1)
    assert init_runtime(8) == runtime  # a second call returns the same answer


def test_runtime_refuses_another_device_count(runtime):
    with pytest.raises(RuntimeError, match="already started with 8 CPU devices.*cpu_devices=4"):
        init_runtime(4)


@pytest.mark.parametrize("shape, expected", [
    (None, (8, 1)), ((4, 2), (4, 2)), ((-1, 2), (4, 2)), ((2, -1), (2, 4)), ((1, 8), (1, 8))])
def test_mesh_shapes(shape, expected):
    mesh = make_mesh(shape)
    assert tuple(mesh.mesh_shape) == expected
    assert mesh.axis_names == ("data", "model")
    np.testing.assert_array_equal(mesh.get_logical_mesh(), np.arange(8).reshape(expected))


def test_one_axis_mesh():
    mesh = make_mesh(axis_names=("fsdp",))
    assert tuple(mesh.mesh_shape) == (8,) and mesh.axis_names == ("fsdp",)


def test_hybrid_mesh_keeps_each_slice_together():
    # 2 slices of 4 devices on 'data': rows 0-1 are slice 0 (devices 0-3), rows 2-3 slice 1.
    mesh = make_mesh((2, 2), dcn_shape=(2, 1))
    assert tuple(mesh.mesh_shape) == (4, 2)
    np.testing.assert_array_equal(mesh.get_logical_mesh(), [[0, 1], [2, 3], [4, 5], [6, 7]])
    # 2 slices on 'model': each row is [slice 0 part, slice 1 part]
    np.testing.assert_array_equal(hybrid_device_ids((4, 1), (1, 2)), [[0, 4], [1, 5], [2, 6], [3, 7]])
    assert sorted(hybrid_device_ids((2, 2), (2, 1)).flatten()) == list(range(8))


@pytest.mark.parametrize("kwargs, message", [
    (dict(shape=(3, 2)), r"holds 6 devices .* 8 devices .* shape=\(4, 2\)"),
    (dict(shape=(16, 1)), r"holds 16 devices .* shape=\(8, 1\)"),
    (dict(shape=(-1, 3)), r"shape=\(8, 1\)"),
    (dict(shape=(4, 2), axis_names=("data",)), "2 axes but axis_names"),
    (dict(shape=(4, 2), axis_names=("data", "data")), "repeat a name"),
    (dict(shape=(2, 2), dcn_shape=(3, 1)), "divides the 8 devices"),
    (dict(shape=(4, 2), dcn_shape=(2, 1)), r"each of 2 slices .* shape=\(2, 2\)"),
])
def test_bad_meshes_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(**kwargs)
