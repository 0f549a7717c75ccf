"""hlo.collectives on HLO text as the TPU backend prints it, and on HLO this CPU compiles.

TPUs run collectives asynchronously. The async forms below follow XLA's own tests (openxla/xla:
hlo_parser_test's AllReduceStartAndDone and CollectivePermuteStartAndDone,
convert_async_collectives_to_sync_test's SimpleAllGather, CombinedCollectivePermute and
SimpleReduceScatter, hlo_instruction_test's async reduce-scatter printed with and without syntax
sugar, async_collective_creator_test's generic async all-reduce), written with the TPU's tiled
layouts: {1,0:T(8,128)}, bf16's {1,0:T(8,128)(2,1)}, scalars' {:T(128)}.
"""
import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs

from llama_xla_helpers.hlo import collectives, compiled_hlo
from llama_xla_helpers.mesh import make_mesh

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
