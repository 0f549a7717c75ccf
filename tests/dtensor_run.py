"""The processes tests/test_dtensor.py starts; each writes one JSON line per check.

    torchrun --nproc-per-node 4 tests/dtensor_run.py dtensor OUT SPMD_CKPT  # gloo; rank 0 writes OUT/dtensor.jsonl
    torchrun --nproc-per-node 4 tests/dtensor_run.py bad-world | bad-heads  # every rank prints its error
    CPU_NUM_DEVICES=4 python tests/dtensor_run.py spmd OUT                   # torch_xla SPMD on 4 CPU devices
    CPU_NUM_DEVICES=4 python tests/dtensor_run.py spmd-load OUT CKPT         # a DTensor checkpoint into SPMD

The torchrun ranks never touch an XLA device; the SPMD processes are the test's children, not theirs.
"""
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from llama_xla_helpers.configs import get_config
from llama_xla_helpers.data import ByteTokenizer
from llama_xla_helpers.train import TrainConfig, init_weights, make_optimizer, optimizer_step

CONFIG = get_config("tiny", num_hidden_layers=2)
BATCH, SEQ_LEN, STEPS = 4, 32, 2
TRAIN = TrainConfig(optimizer="adamw", lr=1e-3)  # make_optimizer: optim.AdamW, weight decay 0.1, constant lr
MESHES = [((2, 2), "2d"), ((1, 4), "2d"), ((2, 2), "fsdp")]
PROMPT = ByteTokenizer().encode("DTensor or XLA?", bos=True)  # 16 ids
MAX_NEW, MAX_SEQ = 16, 64


def dataset():
    """STEPS batches of BATCH rows of SEQ_LEN random token ids, the same in every process."""
    ids = torch.randint(CONFIG.vocab_size, (BATCH * STEPS, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    return TensorDataset(ids)


def reference_model(seed=0):
    """The unsharded LlamaForCausalLM on the CPU, with `train.init_weights` (as both sharded models)."""
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM(CONFIG)
    init = init_weights(CONFIG, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init(name, tuple(p.shape))())
    return model.eval()


def emit(**fields):
    """One JSON line in one write, so the lines of several ranks do not interleave (PIPE_BUF: 4096 bytes)."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def writer(path):
    """emit(), into a file: the positive launch's lines are long, and gloo prints to stdout too."""
    def emit_to(**fields):
        with open(path, "a") as f:
            f.write(json.dumps(fields) + "\n")
    return emit_to


# --- torchrun ranks -------------------------------------------------------------------------------

def blocks(model):
    """{name: [[rank, [[start, stop] per dim]], ...]} of every parameter, gathered from all ranks."""
    import torch.distributed as dist
    from llama_xla_helpers.dtensor import local_block
    mine = {n: [[s.start, s.stop] for s in local_block(p.shape, p.device_mesh, p.placements)]
            for n, p in model.named_parameters()}
    assert all(list(p.to_local().shape) == [b - a for a, b in mine[n]] for n, p in model.named_parameters())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {n: [[r, every[r][n]] for r in range(len(every))] for n in mine}


def dtensor_checks(out, spmd_ckpt):
    import torch.distributed as dist
    from llama_xla_helpers import dtensor
    from llama_xla_helpers.model import Llama

    dist.init_process_group("gloo")
    lead = dist.get_rank() == 0
    emit = writer(out / "dtensor.jsonl")
    data = dataset()
    ref = reference_model() if lead else None
    want = ref(input_ids=data.tensors[0][:BATCH]).logits.detach() if lead else None  # (BATCH, SEQ_LEN, vocab)
    meshes = {}
    for shape, strategy in MESHES:
        mesh = meshes.setdefault(shape, dtensor.device_mesh(shape, CONFIG, strategy))
        model = dtensor.build_model(CONFIG, mesh, strategy)
        table = blocks(model)
        if lead:
            emit(check="blocks", mesh=shape, strategy=strategy, blocks=table)
        (ids,) = next(dtensor.local_batches(data, BATCH, mesh))
        with torch.no_grad():
            logits = dtensor.forward(model, ids)
        got = logits.full_tensor()
        if lead:
            emit(check="logits", mesh=shape, strategy=strategy, placements=str(logits.placements),
                 max_abs_diff=(got - want).abs().max().item())

    mesh = meshes[(2, 2)]
    model = dtensor.build_model(CONFIG, mesh)
    optimizer = make_optimizer(TRAIN, model.parameters())
    model.train()
    losses = [dtensor.train_step(model, optimizer, ids).full_tensor().item()
              for (ids,) in dtensor.local_batches(data, BATCH, mesh)]
    weights = {n: p.full_tensor() for n, p in model.named_parameters()}
    if lead:
        ref.train()
        ref_optimizer = make_optimizer(TRAIN, ref.parameters())
        ref_losses = [optimizer_step(ref, ref_optimizer, ids, clip_norm=None)[0].item()  # the whole batch at once
                      for ids in data.tensors[0].split(BATCH)]
        torch.save(weights, out / "dtensor_weights.pt")
        torch.save({n: p.detach() for n, p in ref.named_parameters()}, out / "unsharded_weights.pt")
        emit(check="train", losses=losses, unsharded_losses=ref_losses)
    saved = dtensor.save(out / "dtensor_ckpt", STEPS, model)

    fresh = dtensor.build_model(CONFIG, mesh, seed=1)
    dtensor.load(spmd_ckpt, fresh)
    loaded = {n: p.full_tensor() for n, p in fresh.named_parameters()}
    if lead:
        torch.save(loaded, out / "dtensor_loaded.pt")
        emit(check="checkpoint", saved=str(saved), loaded=str(spmd_ckpt))

    unsharded = Llama.from_hf(reference_model(), max_batch_size=1, max_seq_len=MAX_SEQ)
    want_tokens = dtensor.greedy_decode(unsharded, PROMPT, MAX_NEW)
    with torch.no_grad():  # teacher-forced top-2 gaps: how far each pick is from a tie
        top2 = unsharded(torch.tensor([PROMPT + want_tokens]), torch.arange(len(PROMPT) + MAX_NEW))[0].topk(2).values
    margin = (top2[len(PROMPT) - 1:-1, 0] - top2[len(PROMPT) - 1:-1, 1]).min().item()
    for shape in [(1, 4), (2, 2)]:
        tp = dtensor.parallelize_for_decode(Llama.from_hf(reference_model(), max_batch_size=1, max_seq_len=MAX_SEQ),
                                            meshes[shape])
        cache = tuple(tp.layers[0].self_attn.kv_cache.k_cache.shape)
        tokens = dtensor.greedy_decode(tp, PROMPT, MAX_NEW)
        if lead:
            emit(check="decode", mesh=shape, tokens=tokens, unsharded=want_tokens, min_margin=margin,
                 local_cache=cache, cache_type=type(tp.layers[0].self_attn.kv_cache.k_cache).__name__)
    dist.destroy_process_group()


def bad_input(case):
    """Each rank asks for a mesh that cannot work and prints the error it gets."""
    from llama_xla_helpers import dtensor
    config, shape = (CONFIG, (2, 4)) if case == "bad-world" else (get_config("tiny", num_key_value_heads=2), (1, 4))
    try:
        dtensor.device_mesh(shape, config)
    except ValueError as e:
        emit(rank=int(os.environ["RANK"]), error=str(e))
        sys.exit(3)
    emit(rank=int(os.environ["RANK"]), error=None)


# --- torch_xla SPMD (a plain process, CPU_NUM_DEVICES=4) -----------------------------------------------

def spmd_checks(out):
    import torch_xla
    from llama_xla_helpers import checkpoint
    from llama_xla_helpers.generate import Generator
    from llama_xla_helpers.mesh import make_mesh
    from llama_xla_helpers.model import Llama
    from llama_xla_helpers.runtime import init_runtime
    from llama_xla_helpers.sharding import device_blocks, sharded_loader
    from llama_xla_helpers.train import build_model

    init_runtime()
    for shape, strategy in MESHES:
        model = build_model(CONFIG, make_mesh(shape), strategy)
        table = {n: sorted([d, [[s.start, s.stop] for s in index]] for d, index in device_blocks(p))
                 for n, p in model.named_parameters()}
        emit(check="blocks", mesh=shape, strategy=strategy, blocks=table)

    mesh = make_mesh((2, 2))
    model = build_model(CONFIG, mesh)
    optimizer = make_optimizer(TRAIN, model.parameters())
    model.train()
    losses = []
    for (ids,) in sharded_loader(dataset(), BATCH, mesh):
        loss, _ = optimizer_step(model, optimizer, ids, clip_norm=None)
        torch_xla.sync()
        losses.append(loss.item())
    torch.save({n: p.cpu() for n, p in model.named_parameters()}, out / "spmd_weights.pt")
    saved = checkpoint.save(out / "spmd_ckpt", STEPS, model)
    emit(check="train", losses=losses, checkpoint=str(saved))

    llama = Llama.from_hf(reference_model(), max_batch_size=1, max_seq_len=MAX_SEQ)
    [tokens], _ = Generator(llama, buckets=(len(PROMPT),)).generate([PROMPT], MAX_NEW)
    emit(check="generator", tokens=tokens)


def spmd_load(out, path):
    from llama_xla_helpers import checkpoint
    from llama_xla_helpers.mesh import make_mesh
    from llama_xla_helpers.runtime import init_runtime
    from llama_xla_helpers.train import build_model

    init_runtime()
    model = build_model(CONFIG, make_mesh((2, 2)), seed=1)
    checkpoint.load(path, model)
    torch.save({n: p.cpu() for n, p in model.named_parameters()}, out / "spmd_loaded.pt")
    emit(check="spmd-load", path=str(path))


if __name__ == "__main__":
    mode, *paths = sys.argv[1:]
    paths = [Path(p) for p in paths]
    {"dtensor": dtensor_checks, "spmd": spmd_checks, "spmd-load": spmd_load,
     "bad-world": lambda: bad_input("bad-world"), "bad-heads": lambda: bad_input("bad-heads")}[mode](*paths)
