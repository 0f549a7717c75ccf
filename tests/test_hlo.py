"""hlo.collectives on HLO text as the TPU backend prints it, and on HLO this CPU compiles.

TPUs run collectives asynchronously. The async forms below follow XLA's own tests (openxla/xla:
hlo_parser_test's AllReduceStartAndDone and CollectivePermuteStartAndDone,
convert_async_collectives_to_sync_test's SimpleAllGather, CombinedCollectivePermute and
SimpleReduceScatter, hlo_instruction_test's async reduce-scatter printed with and without syntax
sugar, async_collective_creator_test's generic async all-reduce), written with the TPU's tiled
layouts: {1,0:T(8,128)}, bf16's {1,0:T(8,128)(2,1)}, scalars' {:T(128)}.
"""
import os

import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from llama_xla_helpers.hlo import (BUFFER_ASSIGNMENT, aliased_parameters, check_count, collectives, compiled_hlo, exact_on_cpu,
                                   instructions, op_count, partitioner_warnings, temp_bytes)
from llama_xla_helpers.mesh import make_mesh

pytestmark = pytest.mark.fixed_dtype  # no test here reads the default dtype (conftest checks)

# One collective per case, as (HLO lines, its op, bytes of its output per device). Every async
# case has its -done (or async-done) line too: it must not be counted.
ASYNC = {
    # TPUs run all-reduce asynchronously: all-reduce-start's result is the output itself.
    "all-reduce-start": ("""
  %all-reduce-start.1 = f32[256,128]{1,0:T(8,128)} all-reduce-start(f32[256,128]{1,0:T(8,128)} %fusion.7), channel_id=8, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%region_20.995, backend_config={"collective_backend_config":{"is_sync":false}}
  %all-reduce-done.1 = f32[256,128]{1,0:T(8,128)} all-reduce-done(f32[256,128]{1,0:T(8,128)} %all-reduce-start.1)
""", "all-reduce", 256 * 128 * 4),
    # Several operands reduced at once (the all-reduce combiner): a tuple of outputs.
    "combined all-reduce-start": ("""
  %all-reduce-start.2 = (f32[256]{0:T(256)}, bf16[512,128]{1,0:T(8,128)(2,1)}) all-reduce-start(f32[256]{0:T(256)} %p.1, bf16[512,128]{1,0:T(8,128)(2,1)} %p.2), channel_id=9, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
  %all-reduce-done.2 = (f32[256]{0:T(256)}, bf16[512,128]{1,0:T(8,128)(2,1)}) all-reduce-done((f32[256]{0:T(256)}, bf16[512,128]{1,0:T(8,128)(2,1)}) %all-reduce-start.2)
""", "all-reduce", 256 * 4 + 512 * 128 * 2),
    # (operand, output): bf16 gathered from (64, 128) to (256, 128).
    "all-gather-start": ("""
  %all-gather-start = (bf16[64,128]{1,0:T(8,128)(2,1)}, bf16[256,128]{1,0:T(8,128)(2,1)}) all-gather-start(bf16[64,128]{1,0:T(8,128)(2,1)} %param.2), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true, backend_config={"collective_backend_config":{"is_sync":false}}
  %all-gather-done = bf16[256,128]{1,0:T(8,128)(2,1)} all-gather-done((bf16[64,128]{1,0:T(8,128)(2,1)}, bf16[256,128]{1,0:T(8,128)(2,1)}) %all-gather-start)
""", "all-gather", 256 * 128 * 2),
    # Two gathers combined: ((operands), (outputs)).
    "combined all-gather-start": ("""
  %all-gather-start.3 = ((f32[32,128]{1,0:T(8,128)}, f32[8]{0:T(256)}), (f32[128,128]{1,0:T(8,128)}, f32[32]{0:T(256)})) all-gather-start(f32[32,128]{1,0:T(8,128)} %fusion.1, f32[8]{0:T(256)} %fusion.2), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %all-gather-done.3 = (f32[128,128]{1,0:T(8,128)}, f32[32]{0:T(256)}) all-gather-done(((f32[32,128]{1,0:T(8,128)}, f32[8]{0:T(256)}), (f32[128,128]{1,0:T(8,128)}, f32[32]{0:T(256)})) %all-gather-start.3)
""", "all-gather", (128 * 128 + 32) * 4),
    # (operand, output, u32[] context, u32[] context).
    "collective-permute-start": ("""
  %collective-permute-start = (f32[8,128]{1,0:T(8,128)}, f32[8,128]{1,0:T(8,128)}, u32[]{:T(128)}, u32[]{:T(128)}) collective-permute-start(f32[8,128]{1,0:T(8,128)} %fusion.3), channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %collective-permute-done = f32[8,128]{1,0:T(8,128)} collective-permute-done((f32[8,128]{1,0:T(8,128)}, f32[8,128]{1,0:T(8,128)}, u32[]{:T(128)}, u32[]{:T(128)}) %collective-permute-start)
""", "collective-permute", 8 * 128 * 4),
    # An async-wrapped reduce-scatter as XLA prints it by default (syntax sugar): ((operands), output).
    "reduce-scatter-start": ("""
  %reduce-scatter-start = ((f32[1024,128]{1,0:T(8,128)}), f32[256,128]{1,0:T(8,128)}) reduce-scatter-start(f32[1024,128]{1,0:T(8,128)} %fusion.9), channel_id=5, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%add
  %reduce-scatter-update = ((f32[1024,128]{1,0:T(8,128)}), f32[256,128]{1,0:T(8,128)}) reduce-scatter-update(((f32[1024,128]{1,0:T(8,128)}), f32[256,128]{1,0:T(8,128)}) %reduce-scatter-start)
  %reduce-scatter-done = f32[256,128]{1,0:T(8,128)} reduce-scatter-done(((f32[1024,128]{1,0:T(8,128)}), f32[256,128]{1,0:T(8,128)}) %reduce-scatter-update)
""", "reduce-scatter", 256 * 128 * 4),
    # The same without syntax sugar: async-start calls a computation that holds the plain op.
    "async-start calls=%wrapped_reduce_scatter": ("""
%wrapped_reduce_scatter (param_0: f32[1024,128]) -> f32[256,128] {
  %param_0 = f32[1024,128]{1,0:T(8,128)} parameter(0)
  ROOT %reduce-scatter.1 = f32[256,128]{1,0:T(8,128)} reduce-scatter(f32[1024,128]{1,0:T(8,128)} %param_0), channel_id=5, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%add
}

ENTRY %main.42_spmd (param.1: f32[1024,128]) -> f32[256,128] {
  %param.1 = f32[1024,128]{1,0:T(8,128)} parameter(0)
  %reduce-scatter-start = ((f32[1024,128]{1,0:T(8,128)}), f32[256,128]{1,0:T(8,128)}) async-start(f32[1024,128]{1,0:T(8,128)} %param.1), calls=%wrapped_reduce_scatter
  ROOT %reduce-scatter-done = f32[256,128]{1,0:T(8,128)} async-done(((f32[1024,128]{1,0:T(8,128)}), f32[256,128]{1,0:T(8,128)}) %reduce-scatter-start), calls=%wrapped_reduce_scatter
}
""", "reduce-scatter", 256 * 128 * 4),
    # An all-reduce wrapped by the generic async ops: ((operands), output), sugared as all-reduce-start.
    "wrapped all-reduce-start": ("""
  %all-reduce-start.4 = ((f32[1024]{0:T(1024)}), f32[1024]{0:T(1024)}) all-reduce-start(f32[1024]{0:T(1024)} %p0), replica_groups={}, to_apply=%add
  ROOT %all-reduce-done.4 = f32[1024]{0:T(1024)} all-reduce-done(((f32[1024]{0:T(1024)}), f32[1024]{0:T(1024)}) %all-reduce-start.4)
""", "all-reduce", 1024 * 4),
    # A complex all-to-all, names printed without '%' as newer XLA dumps do.
    "all-to-all-start": ("""
  all-to-all-start = ((c64[64,8,128]{2,1,0:T(8,128)}), c64[64,8,128]{2,1,0:T(8,128)}) all-to-all-start(c64[64,8,128]{2,1,0:T(8,128)} bitcast.33.0), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={2}
  all-to-all-done = c64[64,8,128]{2,1,0:T(8,128)} all-to-all-done(all-to-all-start)
""", "all-to-all", 64 * 8 * 128 * 8),
}


@pytest.mark.parametrize("case", ASYNC)
def test_each_async_form_counts_once_with_its_output_bytes(case):
    text, op, nbytes = ASYNC[case]
    assert collectives(text) == ({op: 1}, {op: nbytes})


def test_a_module_of_async_and_sync_collectives_sums_them():
    sync = ("  %all-reduce.7 = f32[4,64]{1,0} all-reduce(f32[4,64]{1,0} %dot), channel_id=11, "
            "replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add\n"
            "  ROOT %reduce-scatter.2 = bf16[4]{0} reduce-scatter(bf16[16]{0} %x), dimensions={0}, to_apply=%add\n")
    counts, nbytes = collectives(sync + "".join(text for text, _, _ in ASYNC.values()))
    assert counts == {"all-reduce": 4, "all-gather": 2, "collective-permute": 1, "reduce-scatter": 3, "all-to-all": 1}
    for op in counts:
        want = sum(b for _, o, b in ASYNC.values() if o == op)
        want += {"all-reduce": 4 * 64 * 4, "reduce-scatter": 4 * 2}.get(op, 0)
        assert nbytes[op] == want, op


def test_lines_that_are_not_collectives_are_not_counted():
    text = """
  %fusion.3 = bf16[32,32,4096]{2,1,0:T(8,128)(2,1)} fusion(bf16[32,32,8192]{2,1,0:T(8,128)(2,1)S(1)} %fusion.32), kind=kCustom, calls=%all-reduce-scatter.3
  %get-tuple-element = f32[128]{0} get-tuple-element((f32[128]{0}, f32[128]{0}) %collective-permute), index=0
  %all-gather-done = f32[8,8]{1,0} all-gather-done((f32[2,8]{1,0}, f32[8,8]{1,0}) %ag)
"""
    assert collectives(text) == ({}, {})


def test_collectives_counted_from_compiled_hlo():
    mesh = make_mesh((4, 2))
    a = torch.randn(16, 32, device=torch_xla.device())
    b = torch.randn(32, 64, device=torch_xla.device())
    xs.mark_sharding(a, mesh, ("data", "model"))   # contraction dim split on 'model' ...
    xs.mark_sharding(b, mesh, ("model", None))     # ... so partial sums must be all-reduced
    with compiled_hlo() as modules:
        c = a @ b
        torch_xla.sync()
    counts, nbytes = collectives("".join(modules))
    assert counts == {"all-reduce": 1}
    assert nbytes == {"all-reduce": (16 // 4) * 64 * 4}  # one (4, 64) fp32 block per device
    torch.testing.assert_close(c.cpu(), a.cpu() @ b.cpu())


@pytest.mark.parametrize("kind, measured, at_least, message", [
    ("CPU", 26, False, None), ("CPU", 20, False, "20; expected 26 exactly"), ("CPU", 27, True, "27; expected 26 exactly"),
    ("TPU", 26, False, None), ("TPU", 20, False, None), ("TPU", 27, False, "27; expected 26 or fewer"),
    ("TPU", 27, True, None), ("TPU", 20, True, "20; expected 26 or more"),
])
def test_check_count_is_exact_on_xla_cpu_and_a_bound_elsewhere(monkeypatch, kind, measured, at_least, message):
    # The device kind faked: a TPU's compiler combines collectives (fewer) and may split loops (more).
    monkeypatch.setattr(xr, "device_type", lambda: kind)
    assert exact_on_cpu() == (kind == "CPU")
    if message is None:
        check_count(measured, 26, "all-reduces", at_least=at_least)
    else:
        with pytest.raises(AssertionError, match=rf"^all-reduces: {message}"):
            check_count(measured, 26, "all-reduces", at_least=at_least)


def test_instructions_of_one_op_and_their_count():
    text = """
  %dot.1 = f32[4,64]{1,0} dot(f32[4,32]{1,0} %a, f32[32,64]{1,0} %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %dot_fusion = f32[4,64]{1,0} fusion(f32[4,32]{1,0} %a), kind=kOutput, calls=%fused_dot
  ROOT %dot.2 = f32[4,4]{1,0} dot(f32[4,64]{1,0} %dot.1, f32[4,64]{1,0} %c), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %all-to-all.1 = (f32[1,156,32]{2,1,0}, f32[1,156,32]{2,1,0}) all-to-all(f32[1,156,32]{2,1,0} %p, f32[1,156,32]{2,1,0} %q), replica_groups={{0,1}}
"""
    assert op_count(text, "dot") == 2 and op_count(text, "fusion") == 1
    [line] = instructions(text, "all-to-all")
    assert line.startswith("%all-to-all.1 = (f32[1,156,32]") and line.endswith("replica_groups={{0,1}}")


def test_temp_bytes_is_the_preallocated_temp_of_a_compiled_step():
    assignment = """allocation 0: size 4194304, maybe-live-out:
allocation 240: size 36864080, preallocated-temp:
 value: <1 fusion.3 @0> (size=16,offset=0): f32[4]{0}
allocation 241: size 64, thread-local:
"""
    assert temp_bytes(assignment) == 36864080
    a = torch.randn(64, 64, device=torch_xla.device())
    with compiled_hlo(BUFFER_ASSIGNMENT) as buffers:
        b = (a @ a).relu() @ a   # an intermediate (64, 64) lives in scratch memory
        torch_xla.sync()
    assert temp_bytes("".join(buffers)) >= 64 * 64 * 4
    torch.testing.assert_close(b.cpu(), (a.cpu() @ a.cpu()).relu() @ a.cpu(), rtol=1e-4, atol=1e-3)


def test_partitioner_warnings_are_collected_and_other_stderr_passes_through(capfd):
    line = ("W0000 00:00:1795422894.788538   10979 spmd_partitioner.cc:643] [SPMD] Involuntary full "
            "rematerialization. The compiler cannot go from sharding {devices=[1,8,1,1]0,1,2,3,4,5,6,7} to "
            "{devices=[1,1,1,2,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate} efficiently for HLO operation "
            "%broadcast.202 = f32[16,1,47,16]{3,2,1,0} broadcast(%multiply.201), dimensions={0,1,2,3}\n")
    with partitioner_warnings() as warned:
        os.write(2, line.encode() + b"another message from XLA\n")  # as XLA's C++ logging writes: fd 2
    assert warned == [("{devices=[1,8,1,1]0,1,2,3,4,5,6,7}",
                       "{devices=[1,1,1,2,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}",
                       "f32[16,1,47,16]{3,2,1,0}", "broadcast")]
    err = capfd.readouterr().err
    assert "another message from XLA" in err and "Involuntary" not in err


def test_aliased_parameters_reads_the_modules_first_line():
    head = ("HloModule SyncTensorsGraph.7, is_scheduled=true, input_output_alias={ {0}: (2, {}, may-alias), "
            "{1}: (5, {}, must-alias) }, entry_computation_layout={(s64[4]{0}, f32[8]{0}, f32[3,64,4,16]{3,2,1,0}, "
            "f32[]{:T(128)}, bf16[2,8]{1,0:T(8,128)(2,1)}, /*index=5*/f32[3,64,4,16]{3,2,1,0})->(f32[3,64,4,16]{3,2,1,0}, "
            "f32[3,64,4,16]{3,2,1,0})}, num_partitions=8\nENTRY %main {}")
    aliased, params = aliased_parameters(head)
    assert params == ["s64[4]", "f32[8]", "f32[3,64,4,16]", "f32[]", "bf16[2,8]", "f32[3,64,4,16]"]
    assert aliased == ["f32[3,64,4,16]", "f32[3,64,4,16]"]
