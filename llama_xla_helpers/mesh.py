"""Logical device meshes: a grid of device ids with a name per axis, and hybrid (ICI x DCN) meshes.

On a multi-slice pod, the devices of one slice talk over the fast ICI links and slices talk over
the slower data-center network (DCN). A hybrid mesh lays out each axis as (dcn, ici) so the
axis that communicates most (usually 'model') stays inside a slice.
"""
import math

import numpy as np
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr


def _fit(shape, n):
    """Replace a single -1 in `shape` by what makes the product equal n."""
    shape = tuple(int(s) for s in shape)
    if shape.count(-1) > 1 or any(s < 1 and s != -1 for s in shape):
        raise ValueError(f"mesh shape {shape}: use positive sizes and at most one -1")
    if -1 in shape:
        rest = math.prod(s for s in shape if s != -1)
        shape = tuple(n // rest if s == -1 else s for s in shape) if n % rest == 0 else shape
    return shape


def _suggest(shape, n):
    """A shape with the same number of axes whose product is n (keeps the last axis if it can)."""
    last = shape[-1] if len(shape) > 1 and 0 < shape[-1] <= n and n % shape[-1] == 0 else 1
    return (n // last,) + (1,) * (len(shape) - 2) + (last,) if len(shape) > 1 else (n,)


def hybrid_device_ids(ici_shape, dcn_shape):
    """Device ids for a mesh of shape ici*dcn per axis, slice s holding ids [s*k, (s+1)*k).

    Axis i is laid out as (dcn_i, ici_i): neighbours along an axis share a slice, and
    crossing a slice boundary happens only on the outer (DCN) part of the axis.
    """
    k = len(ici_shape)
    ids = np.arange(math.prod(ici_shape) * math.prod(dcn_shape)).reshape(*dcn_shape, *ici_shape)
    order = [j for i in range(k) for j in (i, k + i)]  # (dcn_0, ici_0, dcn_1, ici_1, ...)
    return ids.transpose(order).reshape([d * i for d, i in zip(dcn_shape, ici_shape)])


def mesh_shape(num_devices=None, config=None):
    """A (data, model) shape for `num_devices` (default: every device of the job) and a model.

    'model' is the widest axis no wider than 'data' (m * m <= n) that splits the model's
    attention and KV heads, MLP width and vocabulary evenly, with hidden_size split over
    'data' (Table 1); without a config, the widest such axis. 1 -> (1, 1), 4 -> (2, 2),
    8 -> (4, 2), 16 -> (4, 4) for the tiny model.
    """
    n = num_devices or xr.global_runtime_device_count()
    on_model = () if config is None else (config.num_attention_heads, config.num_key_value_heads,
                                          config.intermediate_size, config.vocab_size)
    on_data = () if config is None else (config.hidden_size,)
    fits = [m for m in range(1, n + 1) if n % m == 0 and m * m <= n
            and all(s % m == 0 for s in on_model) and all(s % (n // m) == 0 for s in on_data)]
    model = max(fits, default=1)
    return (n // model, model)


def make_mesh(shape=None, axis_names=("data", "model"), dcn_shape=None):
    """A `Mesh` over every device of the job.

    shape: devices per axis (inside one slice when `dcn_shape` is given); None puts all devices
        on the first axis; one -1 is inferred.
    dcn_shape: slices per axis for a multi-slice (hybrid) mesh, e.g. (2, 1) = 2 slices on 'data'.
    """
    axis_names = tuple(axis_names)
    if len(set(axis_names)) != len(axis_names):
        raise ValueError(f"axis_names {axis_names} repeat a name; give each mesh axis its own name")
    n = xr.global_runtime_device_count()
    dcn = _fit(dcn_shape or (1,) * len(axis_names), n)
    slices = math.prod(dcn)
    if len(dcn) != len(axis_names) or n % slices:
        raise ValueError(f"dcn_shape {dcn_shape} needs one size per axis of {axis_names} and a product "
                         f"that divides the {n} devices, e.g. dcn_shape={(2,) + (1,) * (len(axis_names) - 1)}")
    per_slice = n // slices
    ici = _fit(shape if shape is not None else (-1,) + (1,) * (len(axis_names) - 1), per_slice)
    if len(ici) != len(axis_names):
        raise ValueError(f"mesh shape {ici} has {len(ici)} axes but axis_names {axis_names} has "
                         f"{len(axis_names)}; give one name per axis")
    if math.prod(ici) != per_slice:
        where = f"the {n} devices" if slices == 1 else f"the {per_slice} devices of each of {slices} slices"
        raise ValueError(f"mesh shape {tuple(shape)} holds {math.prod(ici)} devices but {where} must all be "
                         f"used; try shape={_suggest(ici, per_slice)}")
    full = tuple(i * d for i, d in zip(ici, dcn))
    if slices > 1 and "slice_index" in xr.global_runtime_device_attributes()[0]:
        # A real multi-slice pod: let torch_xla place devices by physical topology.
        return xs.HybridMesh(ici_mesh_shape=ici, dcn_mesh_shape=dcn, axis_names=axis_names)
    if slices == 1 and xr.device_type() == "TPU":
        # One TPU slice: HybridMesh orders the chips by their torus coordinates (device attribute
        # 'coords'), so neighbours on a mesh axis are neighbours on the ICI links; ids need not be.
        return xs.HybridMesh(ici_mesh_shape=ici, axis_names=axis_names)
    # The CPU (standing in for one slice or several): slices are consecutive device ids.
    return xs.Mesh(hybrid_device_ids(ici, dcn).flatten(), full, axis_names)
