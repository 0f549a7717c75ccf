import numpy as np
import pytest
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr

from llama_xla_helpers.configs import get_config
from llama_xla_helpers.mesh import hybrid_device_ids, make_mesh, mesh_shape
from util import N, eight_devices

# Device id -> (x, y) of its chip on a 4 x 2 slice (a v5e-8), ids scattered over it.
PLACES = [(0, 0), (2, 1), (1, 0), (3, 1), (0, 1), (2, 0), (1, 1), (3, 0)]


def assert_mesh(mesh, shape, axis_names=("data", "model")):
    """What holds on any device: the shape, the axis names, every device exactly once. Device order
    only on a CPU: on one TPU slice make_mesh follows the chips' torus (tested below, faked)."""
    ids = mesh.get_logical_mesh()
    assert ids.shape == tuple(shape) and mesh.axis_names == axis_names
    assert sorted(ids.flatten()) == list(range(N))
    if xr.device_type() == "CPU":
        np.testing.assert_array_equal(ids, np.arange(N).reshape(shape))


@pytest.fixture
def tpu_slice(monkeypatch):
    """This run's 8 devices as the chips of a TPU slice at PLACES (device kind and attributes faked)."""
    attributes = [dict(a, coords=[x, y, 0], core_on_chip=0)
                  for a, (x, y) in zip(xr.global_runtime_device_attributes(), PLACES)]
    monkeypatch.setattr(xr, "device_type", lambda: "TPU")
    monkeypatch.setattr(xr, "global_runtime_device_attributes", lambda: [dict(a) for a in attributes])
    monkeypatch.setattr(xm, "xla_device_hw", lambda device: "TPU")


@pytest.mark.devices
def test_default_mesh_uses_every_device():
    assert_mesh(make_mesh(), (N, 1))
    assert_mesh(make_mesh(axis_names=("fsdp",)), (N,), ("fsdp",))


@pytest.mark.devices
def test_picked_shape_fits_the_devices_and_the_model():
    data, model = mesh_shape(config=get_config("tiny"))
    assert data * model == N and model <= data
    assert_mesh(make_mesh((data, model)), (data, model))
    assert_mesh(make_mesh((-1, model)), (data, model))


def test_mesh_shape_by_device_count():
    tiny = get_config("tiny")  # 8 heads, 4 KV heads, MLP 384, vocabulary 264 = 8 * 33
    assert [mesh_shape(n, tiny) for n in (1, 2, 4, 8, 16, 32)] == [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (8, 4)]
    assert mesh_shape(16, get_config("tiny", num_key_value_heads=2)) == (8, 2)  # 'model' <= KV heads
    assert mesh_shape(256, get_config("llama2-70b")) == (32, 8)  # 8 KV heads cap the 'model' axis
    assert mesh_shape(8) == (4, 2) and mesh_shape(1) == (1, 1)  # no model: only the device count


@eight_devices
@pytest.mark.parametrize("device", ["this run's", "a TPU slice (faked)"])
@pytest.mark.parametrize("shape, expected", [((4, 2), (4, 2)), ((-1, 2), (4, 2)), ((2, -1), (2, 4)), ((1, 8), (1, 8)),
                                             ((8, 1), (8, 1))])
def test_mesh_shapes(shape, expected, device, request):
    if device != "this run's":
        request.getfixturevalue("tpu_slice")
    mesh = make_mesh(shape)
    assert tuple(mesh.mesh_shape) == expected
    assert_mesh(mesh, expected)


@eight_devices
def test_hybrid_mesh_keeps_each_slice_together():
    # 2 slices of 4 devices on 'data': rows 0-1 are slice 0 (devices 0-3), rows 2-3 slice 1.
    mesh = make_mesh((2, 2), dcn_shape=(2, 1))
    assert tuple(mesh.mesh_shape) == (4, 2)
    np.testing.assert_array_equal(mesh.get_logical_mesh(), [[0, 1], [2, 3], [4, 5], [6, 7]])
    # 2 slices on 'model': each row is [slice 0 part, slice 1 part]
    np.testing.assert_array_equal(hybrid_device_ids((4, 1), (1, 2)), [[0, 4], [1, 5], [2, 6], [3, 7]])
    assert sorted(hybrid_device_ids((2, 2), (2, 1)).flatten()) == list(range(8))


@eight_devices
def test_one_tpu_slice_orders_the_mesh_by_the_chips_torus_coordinates(tpu_slice):
    """A TPU's device ids need not follow its chips' places on the ICI torus. Faked: 8 chips of a 4 x 2
    slice (a v5e-8) whose ids are scattered over it. The mesh puts the two devices of each 'model'
    group (the axis that talks most) on neighbouring chips; consecutive ids would not."""
    ids = make_mesh((4, 2)).get_logical_mesh()
    assert sorted(ids.flatten()) == list(range(8))
    distance = lambda a, b: sum(abs(p - q) for p, q in zip(PLACES[a], PLACES[b]))
    assert all(distance(a, b) == 1 for a, b in ids)  # each 'model' pair: ICI neighbours
    assert not all(distance(a, b) == 1 for a, b in np.arange(8).reshape(4, 2))  # what consecutive ids give


@pytest.mark.devices
def test_multi_slice_mesh_puts_slices_on_the_dcn_axis():
    if N % 2:
        pytest.skip("two slices need an even device count")
    mesh = make_mesh((1, N // 2, 1), ("dcn", "data", "model"), dcn_shape=(2, 1, 1))
    ids = mesh.get_logical_mesh()
    assert ids.shape == (2, N // 2, 1)
    np.testing.assert_array_equal(ids[0].flatten(), np.arange(N // 2))  # slice 0 holds devices 0 .. N/2-1
    np.testing.assert_array_equal(ids[1].flatten(), np.arange(N // 2, N))


@pytest.mark.devices
def test_bad_meshes_raise():
    with pytest.raises(ValueError, match=rf"holds {N + 1} devices .* {N} devices"):
        make_mesh((N + 1, 1))
    with pytest.raises(ValueError, match="2 axes but axis_names"):
        make_mesh((N, 1), axis_names=("data",))
    with pytest.raises(ValueError, match="repeat a name"):
        make_mesh((N, 1), axis_names=("data", "data"))
    with pytest.raises(ValueError, match=rf"divides the {N} devices"):
        make_mesh((1, 1), dcn_shape=(N + 1, 1))


@eight_devices
@pytest.mark.parametrize("kwargs, message", [
    (dict(shape=(3, 2)), r"holds 6 devices .* 8 devices .* shape=\(4, 2\)"),
    (dict(shape=(16, 1)), r"holds 16 devices .* shape=\(8, 1\)"),
    (dict(shape=(-1, 3)), r"shape=\(8, 1\)"),
    (dict(shape=(2, 2), dcn_shape=(3, 1)), "divides the 8 devices"),
    (dict(shape=(4, 2), dcn_shape=(2, 1)), r"each of 2 slices .* shape=\(2, 2\)"),
])
def test_bad_meshes_suggest_a_shape(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(**kwargs)
