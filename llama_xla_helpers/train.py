"""2D-sharded training of the Hugging Face Llama, in a step XLA compiles once.

Meta-device init; Adafactor or AdamW on a learning-rate schedule, gradient clipping and
accumulation, all on the device; evaluation, metrics.jsonl, checkpoints and exact resume;
pretraining text or chat SFT, with the byte tokenizer or a Hugging Face one.

    python -m llama_xla_helpers.train --model tiny --steps 300 --checkpoint-dir ckpt
    python -m llama_xla_helpers.train --optimizer adamw --schedule cosine --warmup-steps 30 --clip-norm 1.0
    python -m llama_xla_helpers.train --tokenizer TOKENIZER_DIR --sft chats.jsonl --grad-accum 2 --checkpoint-dir ckpt

Attention (attention.py): torch_xla's flash-attention kernel on a TPU, its algorithm as a
blockwise loop elsewhere, so memory grows with seq_len, not its square; `--attention eager` for
Table 2's attention weights. SFT packs several conversations into each row, kept apart by
segment ids (`--no-pack`: one conversation per row).

The same command runs on this CPU mesh and on a TPU VM or pod (every host runs it; only
process 0 prints and writes shared files). The mesh defaults to `mesh.mesh_shape` for the
devices there are; `--mesh 4,2` fixes it, `--slices 2` spans 2 slices of a multi-slice pod.
"""
import contextlib
import dataclasses
import inspect
import json
import math
import re
import signal
import tempfile
import threading
import time
from argparse import BooleanOptionalAction
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import fsspec
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
import torch_xla.utils.checkpoint
from functorch.compile import default_partition, min_cut_rematerialization_partition
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.data import TensorDataset
from torch_xla._internal import jax_workarounds
from torch_xla.experimental.scan_layers import scan_layers
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from . import checkpoint, lora
from .configs import get_config
from .data import IGNORE_INDEX, StepSampler, load_corpus, train_val_split, training_data
from .hlo import BUFFER_ASSIGNMENT, collectives, compiled_hlo, op_count, temp_bytes
from .mesh import make_mesh, mesh_shape
from .metrics import PEAK_FLOPS, count_compiles, mfu
from .model import DTYPES
from .optim import KINDS, AdamW, Adafactor, Schedule, clip_grad_norm
from .attention import IMPLEMENTATIONS, default_implementation, implementation as attention_of, ran as attention_ran, \
    use as use_attention
from .runlog import RunLog
from .cli import ArgumentParser, int_list, user_errors
from .runtime import chip, compile_cache_counters, compile_cache_summary, default_dtype, init_runtime
from .sharding import (STRATEGIES, axis_size, batch_axes, keyed_generator, shard_activations, shard_params,
                       shard_shape, sharded_loader)
from .tokenizer import TOKENIZER_FILES, ByteTokenizer, get_tokenizer, tokenizer_and_config


@dataclass
class TrainConfig:
    model: str = "tiny"               # a name from configs.get_config
    mesh: tuple = None                # (data, model) devices per slice; None: mesh.mesh_shape's pick
    slices: int = 1                   # multi-slice pod: slices joined over the DCN, on the batch axis
    dtype: str = None                 # "bf16" or "fp32" parameters; None: runtime.default_dtype()
    strategy: str = "2d"              # "2d" (Tables 1 and 2 of the post) or "fsdp"
    attention: str = None             # "eager" (seq_len² weights), "blockwise" or "flash"; None: flash on a TPU, else blockwise
    steps: int = 300                  # total optimizer steps (a resumed run stops here too)
    batch_size: int = 16              # sequences per optimizer step (the global batch), split over 'data'
    seq_len: int = 128                # tokens per sequence
    prefetch: int = 2                 # batches the loader reads and puts on the devices ahead of the steps, on a thread; 0: none
    optimizer: str = "adafactor"      # "adafactor" (lr relative to each weight's RMS) or "adamw"
    lr: float = None                  # the peak learning rate; None: LR[optimizer] (1e-2 Adafactor, 1e-3 AdamW)
    schedule: str = "constant"        # after the warm-up: "constant", "cosine" or "wsd" (optim.Schedule)
    warmup_steps: int = 0             # linear warm-up steps
    min_lr: float = None              # the floor cosine and wsd decay to; None: lr / 10
    weight_decay: float = 0.1         # AdamW's decoupled weight decay
    clip_norm: float = 0.0            # clip the global gradient norm to this (0: no clipping; the norm is logged)
    grad_accum: int = 1               # micro-batches per optimizer step: batch_size rows in K parts, one graph
    seed: int = 0                     # of the random init and the batch order
    data: str = None                  # a local UTF-8 text file or JSONL ("text" per line); default: the embedded corpus
    sft: str = None                   # JSONL chat conversations ("messages"): fine-tune on the assistant's tokens only
    pack: bool = None                 # --sft: several conversations per row (segment ids); None: unless eager or scan_layers
    tokenizer: str = None             # a local Hugging Face tokenizer folder; default: init_from's if it has one, else bytes
    init_from: str = None             # a local Hugging Face directory to fine-tune from; None: a random init (seed)
    lora_rank: int = 0                # LoRA (lora.py): train rank-r adapters, every weight frozen (needs init_from); 0: full
    lora_alpha: float = None          # the adapters' scale is alpha / rank; None: 2 x rank
    lora_targets: tuple = lora.ATTENTION  # the projections LoRA adapts, from lora.TARGETS
    lora_int8: bool = False           # LoRA: store the frozen projections in int8 (QLoRA's idea), compute in dtype
    checkpoint_dir: str = None        # a folder or gs:// URL for checkpoints and metrics.jsonl; None: neither is written
    checkpoint_every: int = 100       # steps between checkpoints (and the last step)
    keep: int = 3                     # checkpoints kept
    async_checkpoint: bool = None     # write checkpoints in the background (checkpoint.AsyncSaver); None: on a TPU (benchmarks/checkpoint.py)
    resume: bool = False              # continue from the newest checkpoint in checkpoint_dir
    eval_every: int = 0               # steps between held-out evaluations; 0: only the one at the end
    eval_batches: int = 8             # held-out batches per evaluation
    log_every: int = 10               # read losses back (and write metrics.jsonl) every this many steps
    gradient_checkpointing: bool = False  # recompute each decoder layer in the backward pass
    scan_layers: bool = False         # run the decoder layers through torch_xla's scan: one layer compiled, not all
    compile_cache: str = None         # a folder keeping compiled programs across runs; None: $LLAMA_XLA_COMPILE_CACHE, if set
    compile_cache_readonly: bool = False  # read compile_cache, write nothing (a cache shared by many jobs)
    progress: bool = False            # a tqdm bar with loss and tokens/s (the CLI turns it on)


INIT_TILE = 64  # a random-init tile is INIT_TILE x INIT_TILE elements, each drawn from its own generator


def init_weights(config, seed, dtype=torch.float32):
    """`init(name, shape)` for `sharding.shard_params`: HF Llama's init (normal(0, initializer_range),
    norms at 1), as `read(index)` functions, so each host draws only the blocks its devices hold.

    Each INIT_TILE x INIT_TILE tile of a weight comes from its own CPU generator, seeded by (seed, name,
    tile row, tile column), in fp32 (the same numbers whatever the dtype), then cast to `dtype`. So the
    weights do not depend on the mesh or the number of hosts, and a block costs the tiles it overlaps,
    whichever dimension the mesh splits (minutes per host at 70B otherwise). A single generator for the
    whole model cannot do this: its stream cannot be entered at a block, so each host would draw every
    full tensor to slice its own. `read()` (no index) returns the whole tensor."""
    def init(name, shape):
        if not name.endswith("norm.weight") and len(shape) != 2:
            raise ValueError(f"init_weights draws 2-D weights (out, in); {name} has shape {tuple(shape)}")

        def read(index=None):
            index = tuple(slice(0, n) for n in shape) if index is None else index  # a slice per dim
            if name.endswith("norm.weight"):
                return torch.ones(tuple(s.stop - s.start for s in index), dtype=dtype)
            (r0, r1), (c0, c1) = [(s.start // INIT_TILE, -(-s.stop // INIT_TILE)) for s in index]  # tiles overlapped
            tiles = torch.cat([torch.cat([init_tile(config, seed, name, shape, r, c) for c in range(c0, c1)], dim=1)
                               for r in range(r0, r1)])  # (rows of the tiles, columns of the tiles)
            rows, cols = [slice(s.start - t * INIT_TILE, s.stop - t * INIT_TILE) for s, t in zip(index, (r0, c0))]
            return tiles[rows, cols].to(dtype)
        read.shape = tuple(shape)
        return read
    return init


def init_tile(config, seed, name, shape, row, col):
    """The tile (row, col) of the 2-D tensor `name` (fp32): its rows row * INIT_TILE ... and columns
    col * INIT_TILE ..., from a generator keyed by (seed, name, row, col)."""
    size = [min(INIT_TILE, n - i * INIT_TILE) for n, i in zip(shape, (row, col))]
    gen = keyed_generator(f"{seed}/{name}/{row}/{col}")
    return torch.empty(size).normal_(0.0, config.initializer_range, generator=gen)


def build_model(config, mesh, strategy="2d", seed=0, init_from=None, dtype=torch.float32, attention="eager",
                lora_config=None):
    """A sharded LlamaForCausalLM, built on the meta device and materialized one parameter at a
    time, so the unsharded model never sits in host memory: random weights, or those of `init_from`
    (a local HF directory), of which each host reads only the blocks its devices hold.

    dtype: of the parameters (bf16 on a TPU). Norms, softmax, the loss and Adafactor's state and
    update are computed in fp32 whatever it is. attention: "eager", "blockwise" or "flash"
    (`attention.use`: flash runs on a TPU, blockwise wherever the kernel cannot). lora_config: a
    lora.LoraConfig: every weight frozen, its targets wrapped with adapters (`lora.add`)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config)  # its buffer, computed on the CPU
    init = checkpoint.hf_reader(init_from, dtype) if init_from else init_weights(config, seed, dtype)
    shard_params(model, mesh, strategy, init=init)
    if lora_config:  # before Table 2's hooks, which then annotate each adapted projection's sum
        lora.add(model, lora_config, mesh, seed)
    if strategy == "2d":
        shard_activations(model, mesh)  # its own eager attention, with Table 2's annotations
    else:  # SDPA's mask shortcut reads the attention mask back to the host: a sync inside every step
        model.set_attn_implementation("eager")  # (on XLA, SDPA lowers to the same math)
    use_attention(model, mesh, attention)
    return model


def forward_loss(model, ids, labels=None, num_items=None, segment_ids=None, position_ids=None):
    """Mean next-token loss of ids (bsz, seqlen) over the tokens `labels` (bsz, seqlen) predicts
    (default: ids, every token; IGNORE_INDEX where a token counts not). With num_items (a tensor), the sum
    of the token losses divided by it instead: a micro-batch's share of a larger batch's mean.

    segment_ids, position_ids (bsz, seqlen): rows packing several conversations (`data.sft_row`),
    each attending only inside its segment, at its own positions; blockwise or flash attention
    (`attention.use`) reads the segment ids, eager attention cannot and refuses them.

    The explicit all-ones attention_mask keeps Transformers 5 from reading position ids back to the
    host (its packed-sequence check), which would cut the step's graph in two and stall the host
    every step."""
    packed = {}
    if segment_ids is not None:
        if attention_of(model) == "eager":
            raise ValueError("packed rows (segment_ids) need attention that keeps their conversations apart, "
                             "and this model's is eager; use attention.use(model, mesh, 'blockwise') (train "
                             "--attention blockwise), or rows of one conversation each (--no-pack)")
        packed = dict(segment_ids=segment_ids, position_ids=position_ids)
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids if labels is None else labels,
                 use_cache=False, num_items_in_batch=num_items, **packed).loss


PACKED = ("segment_ids", "position_ids")  # a packed SFT batch's columns after (ids, labels)


def batch_args(batch):
    """A loader batch, (ids,), (ids, labels) or (ids, labels, segment_ids, position_ids), as the
    arguments of `forward_loss` and `optimizer_step`: ([ids, labels], {segment_ids, position_ids})."""
    return list(batch[:2]), dict(zip(PACKED, batch[2:]))


def optimizer_step(model, optimizer, ids, labels=None, grad_accum=1, clip_norm=0.0, **packed):
    """One optimizer step on the batch ids (bsz, seqlen) (and its labels and, for packed rows, its
    segment_ids and position_ids: `forward_loss`), traced, not run: returns
    (loss, grad_norm), device tensors: the batch's mean loss, and the global gradient norm before
    clipping to clip_norm (0: no clipping, the norm only; None: neither, grad_norm is None).

    grad_accum=K: the batch runs as K micro-batches of bsz / K rows, forward and backward one after
    another, their gradients adding up in p.grad; a micro-batch's loss is its share of the whole
    batch's mean (its token losses' sum over the batch's token count), so the step equals one on the
    whole batch, in a single graph (the loop syncs once per optimizer step). Micro-batch k is rows
    k, k + K, k + 2K, ...: with the batch sharded on 'data' in blocks of bsz / data rows, each
    device's rows of every micro-batch are its own, so splitting moves no data.

    What it does not save: the gradient reduction over 'data' still runs inside each backward pass.
    Measured from the compiled step's HLO (tiny model, fp32, 8 CPU devices, 2D mesh (4, 2), 32 x 24
    tokens; tests/test_train.py): all-reduce outputs per device of 4.07 / 5.67 / 8.74 MiB at K = 1 /
    2 / 4, that is about 2.5 MiB + K x 1.6 MiB, where 1.6 MiB is every gradient's 'model' shard
    (1.63 MiB): one reduction of the gradients per micro-batch. XLA does not fold the K
    reductions into one, and the weights are gathered no more often. So K trades activation memory
    for K times the gradient traffic; on a pod, keep K small or the per-device batch large."""
    if grad_accum == 1:
        loss = forward_loss(model, ids, labels, **packed)
        loss.backward()
    else:
        labels = ids if labels is None else labels
        count = (labels[:, 1:] != IGNORE_INDEX).sum()  # the tokens the batch's loss averages over
        parts = lambda t: t.view(-1, grad_accum, t.shape[1])  # (bsz / K, K, seqlen): [:, k] is micro-batch k
        loss = 0
        for k in range(grad_accum):
            part = forward_loss(model, parts(ids)[:, k], parts(labels)[:, k], count,
                                **{n: parts(t)[:, k] for n, t in packed.items()})
            part.backward()
            loss = loss + part.detach()
    grad_norm = None if clip_norm is None else clip_grad_norm(model.parameters(), clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


def train_step(model, optimizer, ids):
    """The post's step, `optimizer_step` on ids as its own labels, whole, without the gradient norm:
    its loss."""
    return optimizer_step(model, optimizer, ids, clip_norm=None)[0]


@torch.no_grad()
def evaluate(model, val_set, mesh, batch_size, batches):
    """Mean next-token loss (nats per token) on the first `batches` held-out batches of val_set:
    (ids,), (ids, labels) or packed SFT's (ids, labels, segment_ids, position_ids), each (n, seqlen)."""
    model.eval()
    loader = sharded_loader(TensorDataset(*val_set), batch_size, mesh)
    losses = []
    for batch, _ in zip(loader, range(batches)):
        args, packed = batch_args(batch)
        losses.append(forward_loss(model, *args, **packed))
    model.train()
    return torch.stack(losses).mean().item()


@dataclass
class TrainResult:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    losses: dict            # step -> training loss
    val_losses: dict        # step -> held-out loss
    train_compiles: int     # graphs compiled by the training steps (the post expects 2)
    tokens_per_sec_per_chip: float
    mfu: float              # None on CPU: MFU against a CPU has no meaningful peak
    stopped_early: bool = False  # SIGTERM / SIGHUP arrived: checkpointed at the end of a step and stopped
    attention: str = None   # the attention that ran (attention.ran): "flash", "flash (192 padded to 256)", "blockwise", ...


LR = {"adafactor": 1e-2, "adamw": 1e-3}  # default peak learning rates (Adafactor's is relative to each weight's RMS)


def make_optimizer(cfg, params):
    """cfg's optimizer over params, its learning rate on cfg's schedule (a device tensor: no recompiles)."""
    lr = cfg.lr or LR[cfg.optimizer]
    schedule = None if cfg.schedule == "constant" and not cfg.warmup_steps else Schedule(
        cfg.schedule, lr, cfg.warmup_steps, cfg.steps, lr / 10 if cfg.min_lr is None else cfg.min_lr)
    if cfg.optimizer == "adamw":
        return AdamW(params, lr=lr, weight_decay=cfg.weight_decay, schedule=schedule)
    return Adafactor(params, lr=lr, schedule=schedule)


def lr_at(optimizer, step):
    """The learning rate of optimizer step `step` (from 1), as the host computes it for the log."""
    return optimizer.param_groups[0]["lr"] if optimizer.schedule is None else float(optimizer.schedule(step))


def _check_resume(meta, cfg, base=None):
    saved = meta["extra"]["train_config"]
    for key in ("model", "batch_size", "seq_len", "seed", "data", "dtype", "optimizer", "sft", "pack", "tokenizer",
                "lora_rank", "lora_alpha", "lora_targets", "lora_int8"):
        now = json.loads(json.dumps(getattr(cfg, key)))  # as meta.json holds it (a tuple is a list there)
        if saved.get(key, now) != now:  # older checkpoints lack dtype and the lora fields
            raise ValueError(f"cannot resume: the checkpoint was trained with {key}={saved[key]!r} but this "
                             f"run has {key}={getattr(cfg, key)!r}; use the same value or a new checkpoint_dir")
    trained_on = meta["extra"].get("lora_base")
    if trained_on and base and trained_on["sha256"] != base["sha256"]:
        raise ValueError(f"cannot resume: the checkpoint's adapters were trained on the base model in "
                         f"{trained_on['folder']!r} (sha256 {trained_on['sha256'][:12]}...), and init_from="
                         f"{cfg.init_from!r} holds other weights; resume with that base folder")


def lora_config(cfg):
    """The lora.LoraConfig of cfg (a TrainConfig, or meta.json's train_config dict), or None for
    full training (lora_rank 0)."""
    get = cfg.get if isinstance(cfg, dict) else partial(getattr, cfg)
    if not get("lora_rank", 0):
        return None
    targets = get("lora_targets")
    return lora.LoraConfig(get("lora_rank"), get("lora_alpha"), (targets,) if isinstance(targets, str) else tuple(targets),
                           int8=get("lora_int8"))


def lora_base(cfg):
    """What a LoRA checkpoint records of its base model: the init_from folder and its sha256."""
    return dict(folder=str(cfg.init_from), sha256=lora.folder_sha256(cfg.init_from))


POSITIVE = {"steps": "optimizer steps to run", "batch_size": "sequences per step",
            "seq_len": "tokens per sequence", "checkpoint_every": "steps between checkpoints",
            "keep": "checkpoints kept", "eval_batches": "held-out batches per evaluation",
            "log_every": "steps between loss reads", "slices": "slices of a multi-slice pod",
            "grad_accum": "micro-batches per optimizer step"}
NON_NEGATIVE = {"warmup_steps": "linear warm-up steps (0: none)", "clip_norm": "global gradient norm to clip to "
                "(0: no clipping; e.g. 1.0)", "weight_decay": "AdamW's weight decay (e.g. 0.1; 0: none)"}


def check_config(cfg):
    """ValueError naming the field, its value, the limit and a fix, before any work is done."""
    for name, what in POSITIVE.items():
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: the {what} must be an int >= 1")
    for name, what in NON_NEGATIVE.items():
        value = getattr(cfg, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
            raise ValueError(f"{name}={value!r}: the {what} must be a finite number >= 0")
    if cfg.optimizer not in LR:
        raise ValueError(f"optimizer={cfg.optimizer!r} is not one of {', '.join(LR)}")
    if cfg.lr is not None and not (isinstance(cfg.lr, (int, float)) and 0 < cfg.lr < float("inf")):
        raise ValueError(f"lr={cfg.lr!r} must be a finite number > 0 (e.g. 0.01 for Adafactor, which scales it by "
                         f"each weight's RMS; 1e-3 for AdamW), or None for those defaults")
    if cfg.schedule not in KINDS:
        raise ValueError(f"schedule={cfg.schedule!r} is not one of {', '.join(KINDS)}")
    lr = cfg.lr or LR.get(cfg.optimizer)
    if cfg.schedule != "constant" or cfg.warmup_steps:  # the schedule's own checks: warm-up, floor
        Schedule(cfg.schedule, lr, cfg.warmup_steps, cfg.steps, lr / 10 if cfg.min_lr is None else cfg.min_lr)
    if cfg.batch_size % cfg.grad_accum:
        raise ValueError(f"batch_size={cfg.batch_size} is not divisible by grad_accum={cfg.grad_accum}: each "
                         f"optimizer step splits its batch into grad_accum equal micro-batches; use a multiple")
    if not isinstance(cfg.eval_every, int) or cfg.eval_every < 0:
        raise ValueError(f"eval_every={cfg.eval_every!r} must be an int >= 0 (0: evaluate once, at the end)")
    if not isinstance(cfg.prefetch, int) or isinstance(cfg.prefetch, bool) or cfg.prefetch < 0:
        raise ValueError(f"prefetch={cfg.prefetch!r} must be an int >= 0 (batches read ahead; 0: none)")
    if cfg.mesh is not None and (not isinstance(cfg.mesh, (tuple, list)) or len(cfg.mesh) != 2 or
                                 not all(isinstance(k, int) and k >= 1 for k in cfg.mesh)):
        raise ValueError(f"mesh={cfg.mesh!r} must be two ints >= 1, (data, model) devices, e.g. (4, 2); "
                         f"or None to pick one for the devices there are")
    if cfg.strategy not in STRATEGIES:
        raise ValueError(f"strategy={cfg.strategy!r} is not one of {', '.join(STRATEGIES)}")
    if cfg.attention is not None and cfg.attention not in IMPLEMENTATIONS:
        raise ValueError(f"attention={cfg.attention!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    if cfg.pack and not cfg.sft:
        raise ValueError("pack=True (--pack) packs SFT conversations into rows; it needs sft (--sft), or leave it out")
    if cfg.pack and (cfg.attention == "eager" or cfg.scan_layers):
        why = "attention='eager' cannot keep them apart" if cfg.attention == "eager" else \
            "scan_layers' layer step takes no segment ids"
        raise ValueError(f"pack=True puts several conversations in a row, and {why}; use attention='blockwise' "
                         f"(--attention blockwise) without scan_layers, or pack=False (--no-pack)")
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        raise ValueError(f"dtype={cfg.dtype!r} is not one of {', '.join(DTYPES)}")
    if cfg.dtype is None:
        default_dtype()  # a bad LLAMA_XLA_DEFAULT_DTYPE is an error here, before any work
    if cfg.resume and not cfg.checkpoint_dir:
        raise ValueError("resume=True needs checkpoint_dir, the folder to resume from")
    if not isinstance(cfg.lora_rank, int) or isinstance(cfg.lora_rank, bool) or cfg.lora_rank < 0:
        raise ValueError(f"lora_rank={cfg.lora_rank!r} must be an int >= 0 (0: train every weight; e.g. 8 for LoRA)")
    if cfg.lora_rank:
        lora.check(lora_config(cfg))
        if not cfg.init_from:
            raise ValueError(f"lora_rank={cfg.lora_rank} trains adapters on a frozen base model, and init_from is "
                             f"not set; pass the base model's Hugging Face folder (--init-from DIR)")
        if cfg.scan_layers:
            raise ValueError("lora_rank with scan_layers: LoRA is not built for scan over layers here (untested); "
                             "use gradient_checkpointing without scan_layers")
    elif cfg.lora_int8 or cfg.lora_alpha is not None:
        raise ValueError("lora_int8 and lora_alpha configure LoRA adapters, and lora_rank is 0 (full training); "
                         "set lora_rank (e.g. --lora-rank 8), or leave them out")


def model_config(cfg):
    """The LlamaConfig to train: the named one, or the one in the `init_from` folder."""
    if not cfg.init_from:
        return get_config(cfg.model)
    file = Path(cfg.init_from) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"init_from={cfg.init_from!r} has no config.json; pass a local Hugging Face "
                                f"folder (checkpoint.export_hf or save_pretrained writes one)")
    model_type = json.loads(file.read_text()).get("model_type")
    if model_type != "llama":
        raise ValueError(f"{file} describes a {model_type!r} model, not a Llama (model_type 'llama'); "
                         f"pass a LlamaForCausalLM folder")
    return LlamaConfig.from_json_file(file)


TOKENIZER_DIR = "tokenizer"  # checkpoint_dir/tokenizer: the run's Hugging Face tokenizer, for serve and export
ADAPTER_DIR = "adapter"      # checkpoint_dir/adapter: a LoRA run's PEFT adapter folder, written at its end


def tokenizer_path(cfg):
    """cfg's tokenizer folder: --tokenizer, else the init_from folder's own tokenizer; None: the byte tokenizer."""
    if cfg.tokenizer or not cfg.init_from:
        return cfg.tokenizer
    return cfg.init_from if any((Path(cfg.init_from) / f).is_file() for f in TOKENIZER_FILES) else None


def datasets(cfg, tokenizer=None):
    """(train, held-out) tensors for TensorDataset, each (n, seq_len): (ids,) to predict every token,
    or (ids, labels) for --sft (IGNORE_INDEX on all but the assistant's tokens).

    The byte tokenizer (tokenizer None) on the text itself, as before, or a Hugging Face tokenizer
    through a token file in checkpoint_dir (data.training_data: tokenized once by process 0, while
    the other hosts get its name from process 0 and wait for the file, data.wait_seconds: only process 0
    reads --data / --sft; each host reads only its rows)."""
    if tokenizer is None and not cfg.sft and not (cfg.data or "").endswith(".jsonl"):
        train_ids, val_ids = train_val_split(load_corpus(cfg.data), cfg.seq_len)
        return (train_ids,), (val_ids,)
    train_set, val_set = training_data(cfg.seq_len, tokenizer, cfg.data, cfg.sft, cfg.checkpoint_dir,
                                       lead=xr.process_index() == 0, packed=bool(cfg.pack), share=checkpoint.lead_value)
    return train_set.tensors, val_set.tensors


def hf_tokenizer(cfg):
    """cfg's Hugging Face tokenizer (see tokenizer_path), or None for the byte tokenizer."""
    tokenizer = get_tokenizer(tokenizer_path(cfg))
    return None if isinstance(tokenizer, ByteTokenizer) else tokenizer


def save_tokenizer(tokenizer, cfg):
    """Keep a Hugging Face tokenizer beside the checkpoints (process 0), where serve and export find it."""
    if cfg.checkpoint_dir and xr.process_index() == 0 and tokenizer is not None:
        put_folder(tokenizer.save_pretrained, cfg, TOKENIZER_DIR)


def put_folder(write, cfg, name):
    """write(local folder), then copy that folder to checkpoint_dir/name (a folder or a URL)."""
    with tempfile.TemporaryDirectory() as local:
        write(local)
        fs, folder = fsspec.core.url_to_fs(f"{str(cfg.checkpoint_dir).rstrip('/')}/{name}")
        fs.put(f"{local}/", folder, recursive=True)


def setup(cfg):
    """Start the runtime; returns (cfg with dtype, mesh and lr filled in, mesh, LlamaConfig)."""
    check_config(cfg)
    _, config = tokenizer_and_config(model_config(cfg), tokenizer_path(cfg), pretrained=bool(cfg.init_from))
    slices = cfg.slices
    # On a CPU an explicit mesh sizes the stand-in; on a TPU the mesh must match the chips (make_mesh checks).
    init_runtime(cpu_devices=math.prod(cfg.mesh) * slices if cfg.mesh else None, cache_dir=cfg.compile_cache,
                 cache_readonly=cfg.compile_cache_readonly)
    if cfg.scan_layers:
        check_scan_extra()
    shape = tuple(cfg.mesh) if cfg.mesh else mesh_shape(xr.global_runtime_device_count() // slices, config)
    dtype = cfg.dtype or default_dtype()
    if slices == 1:
        mesh = make_mesh(shape)
    else:  # the batch crosses slices over the DCN; weights stay sharded inside each slice
        mesh = make_mesh((1,) + shape, ("dcn", "data", "model"), dcn_shape=(slices, 1, 1))
    rows, k = cfg.batch_size // cfg.grad_accum, axis_size(mesh, batch_axes(mesh))
    if cfg.grad_accum > 1 and rows % k:  # (without accumulation, sharded_loader says it of the batch)
        raise ValueError(f"a micro-batch of batch_size / grad_accum = {rows} rows cannot be split over the "
                         f"{k} devices of the batch axes; use a batch_size that is a multiple of {k * cfg.grad_accum}")
    attention = cfg.attention or default_implementation()
    if cfg.scan_layers and attention == "flash":
        raise ValueError("scan_layers with flash attention (the TPU's default): torch_xla 2.9's kernel cannot be traced "
                         "by scan (its fake forward gives the log-sum-exp the wrong rank); use attention='blockwise' "
                         "(--attention blockwise) with scan_layers, or leave scan_layers out")
    pack = cfg.pack if cfg.pack is not None else bool(cfg.sft) and attention != "eager" and not cfg.scan_layers
    # In the background the steps wait only for the copy to host memory, but a save's writing and hashing
    # take host cores: on a TPU the steps run elsewhere; on a CPU they share those cores, and measured on
    # 2 of them (benchmarks/checkpoint.py) the loop lost as much time per save as a synchronous save.
    background = cfg.async_checkpoint if cfg.async_checkpoint is not None else xr.device_type() == "TPU"
    return (dataclasses.replace(cfg, mesh=shape, dtype=dtype, lr=cfg.lr or LR[cfg.optimizer], attention=attention,
                                pack=pack, async_checkpoint=background), mesh, config)


def checkpoint_layers(model):
    """Gradient checkpointing: keep only each decoder layer's input for the backward pass and run
    the layer's forward again there. torch_xla's checkpoint, as torch.utils.checkpoint does not know
    the XLA device; it puts an optimization barrier in the graph so XLA cannot undo the recompute."""
    model._set_gradient_checkpointing(True, partial(torch_xla.utils.checkpoint.checkpoint, use_reentrant=True))
    if not model.get_input_embeddings().weight.requires_grad:  # LoRA: a reentrant checkpoint whose inputs need
        model.enable_input_require_grads()  # no gradient would give its layer's adapters none


def prepare_layers(model, cfg):
    """Apply cfg's layer options: scan over the layers, gradient checkpointing, or both."""
    if cfg.scan_layers:
        scan_decoder_layers(model, recompute=cfg.gradient_checkpointing)
    elif cfg.gradient_checkpointing:
        checkpoint_layers(model)


class _LayerStep(torch.nn.Module):
    """A decoder layer as one step of scan_layers, whose carry goes in and comes out whole: hidden
    (bsz, seqlen, hidden_size), RoPE's cos and sin (1, seqlen, head_dim), and the attention mask
    (bsz, 1, seqlen, seqlen) if the attention function takes one (SDPA's causal flag needs none)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, hidden, cos, sin, *mask):
        hidden = self.layer(hidden, attention_mask=mask[0] if mask else None, position_embeddings=(cos, sin))
        return hidden, cos, sin, *mask


def recompute_all(joint_module, joint_inputs, *, num_fwd_outputs, **kwargs):
    """An AOTAutograd partition for scan: save only each layer's inputs and run its whole forward
    again in the backward pass (what checkpoint_layers does to the unrolled model)."""
    for node in joint_module.graph.nodes:
        if node.op == "call_function" and "recompute" not in node.meta:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = 0  # one graph: the partitioner groups recompute tags by this id
    return min_cut_rematerialization_partition(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)


SCAN_INSTALL = ("pip install -e '.[scan]' && pip install --no-deps --force-reinstall torchax==0.0.7 (torch_xla "
                "2.9's wheel bundles an older torchax that needs flax and replaces the extra's)")


def check_scan_extra():
    """Under SPMD, scan_layers' backward calls JAX (torch_xla's `shard_as`), through torchax; fail
    before any work if they do not import, instead of in the first backward pass."""
    if not xr.is_spmd():
        return
    for name, module in (("jax", jax_workarounds.maybe_get_jax(log=False)),
                         ("torchax", jax_workarounds.maybe_get_torchax())):
        if module is None:
            raise ValueError(f"scan_layers=True (--scan-layers) under SPMD needs {name} (jax==0.7.1, "
                             f"torchax==0.0.7), and it does not import here; install them: {SCAN_INSTALL}")


def scan_decoder_layers(model, recompute=False):
    """Run the decoder layers of a LlamaForCausalLM through torch_xla.experimental.scan_layers.

    XLA then compiles one layer inside a loop over the stacked weights, not every layer one after
    another, so compile time stops growing with depth. Forward and backward both loop; the
    sharding of the weights and of the activations inside the layer (shard_params,
    shard_activations) carries into the loop body. Under SPMD, torch_xla 2.9 needs JAX for the
    backward (the `scan` extra).

    recompute: save only each layer's input and recompute the rest in the backward pass (gradient
    checkpointing); otherwise the backward keeps every activation the forward made. Between the
    two, torch's `min_cut_rematerialization_partition` chooses what to recompute: give it to
    scan_layers as `partition_fn` in place of `recompute_all`.

    Only the model's forward changes (one instance's); its modules and state dict stay the same.
    """
    check_scan_extra()
    inner = model.model
    steps = [_LayerStep(layer) for layer in inner.layers]  # kept: scan caches its trace per first step
    partition = recompute_all if recompute else default_partition

    def forward(input_ids, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                **unused):
        if position_ids is not None or past_key_values is not None or inputs_embeds is not None:
            raise ValueError("the scanned model takes input_ids and attention_mask only (training and "
                             "evaluation); use the unrolled model for position_ids, a cache or embeddings")
        hidden = inner.embed_tokens(input_ids)                                  # (bsz, seqlen, hidden_size)
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]  # (1, seqlen)
        mask = create_causal_mask(config=inner.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                  past_key_values=None, position_ids=positions)
        cos, sin = inner.rotary_emb(hidden, positions)                        # (1, seqlen, head_dim) each
        carry = (hidden, cos, sin) + (() if mask is None else (mask,))
        hidden, *_ = scan_layers(steps, carry, partition_fn=partition, is_layer_pure=True)
        return BaseModelOutputWithPast(last_hidden_state=inner.norm(hidden))

    inner.forward = forward
    return model


def train(cfg, group=None):
    """Train as `cfg` says; returns a TrainResult.

    group: the process group on which the hosts of a pod agree when to stop (`should_stop`); None:
    none on one process, and on a pod the gloo group the checkpoints use."""
    cfg, mesh, config = setup(cfg)
    if group is None and xr.process_count() > 1:
        group = checkpoint.host_group()
    resume_from = checkpoint.latest(cfg.checkpoint_dir) if cfg.resume else None
    base = lora_base(cfg) if cfg.lora_rank else None
    if resume_from:
        _check_resume(checkpoint.read_meta(resume_from), cfg, base)
    tokenizer = hf_tokenizer(cfg)
    save_tokenizer(tokenizer, cfg)
    train_set, val_set = datasets(cfg, tokenizer)
    if len(val_set[0]) < cfg.batch_size:  # evaluate() takes whole batches of it
        raise ValueError(f"the held-out split has {len(val_set[0])} rows of seq_len={cfg.seq_len}, fewer than "
                         f"batch_size={cfg.batch_size}, and evaluation needs one whole batch; use more data, a "
                         f"smaller batch_size or a shorter seq_len")
    model = build_model(config, mesh, cfg.strategy, cfg.seed, cfg.init_from, DTYPES[cfg.dtype], cfg.attention,
                        lora_config(cfg))
    prepare_layers(model, cfg)
    optimizer = make_optimizer(cfg, [p for p in model.parameters() if p.requires_grad])
    saved = partial(lora.adapter_state, model) if cfg.lora_rank else lambda: model  # what a checkpoint holds of it
    extra = dict(train_config=dataclasses.asdict(cfg), config=config.to_dict(), dtypes=run_dtypes(cfg.dtype),
                 **(dict(lora_base=base) if base else {}))
    start = 0
    if resume_from:
        checkpoint.init_optimizer_state(optimizer)  # state tensors for load to fill
        start = checkpoint.load(resume_from, saved(), optimizer, verified=True)["step"]  # latest() verified it
        if xr.process_index() == 0:
            print(f"resuming from {Path(str(resume_from)).name}: step {start + 1} next")
    sampler = StepSampler(len(train_set[0]), cfg.batch_size, cfg.seed, start, max(cfg.steps - start, 0))
    loader = sharded_loader(TensorDataset(*train_set), cfg.batch_size, mesh, sampler=sampler, prefetch=cfg.prefetch)
    lead = xr.process_index() == 0
    log = RunLog(cfg.checkpoint_dir, start) if cfg.checkpoint_dir and lead else None
    bar = tqdm(total=cfg.steps, initial=start, disable=not (cfg.progress and lead))
    losses, pending, val_losses, rows, stop = {}, [], {}, [], False  # rows: of metrics.jsonl, not yet written
    clock = Clock()  # the steps' time: saves and evaluations stop it
    dispatched = {start: clock.now()}  # step -> the clock when the host had dispatched it
    model.train()
    compiles = count_compiles()
    saver = checkpoint.AsyncSaver() if cfg.checkpoint_dir and cfg.async_checkpoint else None
    save = saver.save if saver else checkpoint.save
    # Closing the saver (inside stop_signals) waits for the save in flight to commit, a stop signal's too.
    with stop_signals() as got, contextlib.closing(saver) if saver else contextlib.nullcontext():
        for step, batch in enumerate(loader, start + 1):
            args, packed = batch_args(batch)
            loss, grad_norm = optimizer_step(model, optimizer, *args, grad_accum=cfg.grad_accum, clip_norm=cfg.clip_norm,
                                             **packed)
            pending.append((step, torch.stack((loss, grad_norm))))  # one read back for both, part of the step's graph
            torch_xla.sync()  # one graph per step, dispatched: the device runs it while the host goes on
            dispatched[step] = clock.now()
            bar.update(1)
            if step % cfg.log_every == 0:  # read every step's values but this one's: the device is already past them
                rows += read_steps(pending[:-1], losses, dispatched, cfg, optimizer)
                pending = pending[-1:]
                if cfg.progress and rows:
                    bar.set_postfix(loss=f"{rows[-1]['loss']:.3f}", tok_s=f"{rows[-1]['tokens_per_sec']:,.0f}")
            stop = should_stop(step, got, cfg.log_every, group)
            if cfg.checkpoint_dir and (step % cfg.checkpoint_every == 0 or step == cfg.steps or stop):
                with clock.stopped():
                    save(cfg.checkpoint_dir, step, saved(), optimizer, keep=cfg.keep,
                         extra=dict(extra, attention=attention_ran(model)))  # what ran, e.g. padded flash
                rows = write_rows(log, rows, val_losses, count_compiles() - compiles, flush=True)
            if stop:  # preempted: this step is saved; stop here
                break
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                with clock.stopped():
                    before = count_compiles()
                    val_losses[step] = evaluate(model, val_set, mesh, cfg.batch_size, cfg.eval_batches)
                    compiles += count_compiles() - before  # evaluation graphs are not training graphs
            rows = write_rows(log, rows, val_losses, count_compiles() - compiles)
    xm.wait_device_ops()
    done = clock.now()
    rows += read_steps(pending, losses, dispatched, cfg, optimizer)
    train_compiles = count_compiles() - compiles
    bar.close()
    val_losses[max(losses, default=start)] = evaluate(model, val_set, mesh, cfg.batch_size, cfg.eval_batches)
    write_rows(log, rows, val_losses, train_compiles)
    if log:
        log.close()
    if cfg.lora_rank and cfg.checkpoint_dir and not cfg.lora_int8 and xr.process_index() == 0:
        put_folder(partial(lora.peft_adapter, model, base_model=cfg.init_from), cfg, ADAPTER_DIR)
    timed = len(dispatched) - 3  # steps after the two that compile, from the second's dispatch to the end
    tps = cfg.batch_size * cfg.seq_len * timed / (done - dispatched[start + 2]) / mesh.size() if timed > 0 else None
    peak = PEAK_FLOPS.get(chip())
    return TrainResult(model, optimizer, losses, val_losses, train_compiles, tps,
                       mfu(tps, config, cfg.seq_len, peak) if peak and tps else None, stop, attention_ran(model))


class Clock:
    """Seconds of training: `stopped()` holds the clock still (checkpoint saves, evaluations)."""

    def __init__(self):
        self.paused = 0.0

    def now(self):
        return time.perf_counter() - self.paused

    @contextlib.contextmanager
    def stopped(self):
        xm.wait_device_ops()  # the steps already dispatched finish on the clock
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.paused += time.perf_counter() - begin


def read_steps(pending, losses, dispatched, cfg, optimizer):
    """Read the (step, device [loss, grad norm]) pairs back (one wait, then a small copy each) into
    `losses`; returns their metrics.jsonl rows. A step's time is the clock between its dispatch and
    the previous one's: in steady state the host waits for the device, so it is the device's time."""
    rows = []
    for step, values in pending:
        loss, grad_norm = values.tolist()
        losses[step] = loss
        seconds = dispatched[step] - dispatched[step - 1]
        rows.append(dict(step=step, loss=loss, lr=lr_at(optimizer, step), grad_norm=grad_norm, step_time=seconds,
                         tokens_per_sec=cfg.batch_size * cfg.seq_len / seconds))
    return rows


def write_rows(log, rows, val_losses, compiles, flush=False):
    """Write the rows to metrics.jsonl (process 0; `log` None elsewhere), with the held-out loss of the
    steps that have one and `compiles`, the training graphs compiled so far; returns [] (nothing left
    to write)."""
    if log:
        log.write([{**row, "compiles": compiles, **({"val_loss": val_losses[row["step"]]} if row["step"] in val_losses
                                               else {})} for row in rows])
        if flush:
            log.flush()
    return []


def run_dtypes(dtype):
    """What meta.json records of a run's dtypes, apart: its parameters and matmuls (`dtype`), and the
    weights the optimizer updates (fp32 master copies when the parameters are bf16; see Adafactor)."""
    return dict(parameters=dtype, compute=dtype, master_weights="fp32" if dtype != "fp32" else None)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # a spot / preemptible VM's notice; ssh's hang-up at shutdown


@contextlib.contextmanager
def stop_signals():
    """A list that becomes non-empty when SIGTERM or SIGHUP arrives: a spot or preemptible TPU VM's
    notice, or the hang-up a run launched over ssh gets when the VM shuts down.

    Training saves a checkpoint at the end of a step and stops (exit status 0); `should_stop`
    says which step. Signal handlers live in the main thread only; elsewhere the list stays empty.
    """
    got = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return
    previous = {sig: signal.signal(sig, lambda *_: got.append(True)) for sig in STOP_SIGNALS}
    try:
        yield got
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def should_stop(step, got, every, group=None):
    """Whether to checkpoint and stop after `step`, given `got` (this host's `stop_signals()` list).

    One process (group None): as soon as a signal came. A pod's hosts must all save the same step:
    a host that stopped one step early would wait forever in the others' collectives. So every
    `every` steps (train passes log_every) each host puts its flag into one all-reduce (MAX) over
    the gloo `group`, and all stop if any got a signal; between those steps none stops. A signal
    therefore waits at most `every` steps (keep that well inside a spot VM's 30 s notice).
    (torch_xla's preemption sync manager does the same on a TPU, but cannot start anywhere else.)
    """
    if group is None:
        return bool(got)
    if step % every:
        return False
    flag = torch.tensor([int(bool(got))])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(flag.item())


def read_losses(pending, losses):
    """Copy the (step, device loss) pairs to the host dict `losses` (one wait, then small copies)."""
    for step, loss in pending:
        losses[step] = loss.item()


def first_batch(cfg, mesh):
    """The first `cfg.batch_size` sequences of cfg's training data (in cfg's tokenizer; for --sft the ids
    only), sharded over mesh's batch axes: one fixed batch for measuring a step (profiles, compile time,
    compiled HLO)."""
    train_set, _ = datasets(cfg, hf_tokenizer(cfg))
    [(ids, *_)] = list(sharded_loader(TensorDataset(*(t[:cfg.batch_size] for t in train_set)), cfg.batch_size, mesh))
    return ids  # (batch_size, seq_len)


def profile_step(cfg):
    """One steady-state training step as cfg sets it (optimizer, grad_accum, clip_norm), per device:
    bytes of parameters and optimizer state, and, read from its compiled HLO, its scratch bytes
    (activations), matmuls and collectives (needs init_runtime(hlo_dump_dir=...) and shapes not
    compiled before in this process)."""
    cfg, mesh, config = setup(cfg)
    model = build_model(config, mesh, cfg.strategy, cfg.seed, dtype=DTYPES[cfg.dtype], attention=cfg.attention)
    prepare_layers(model, cfg)
    model.train()  # HF checkpoints layers only in training mode
    optimizer = make_optimizer(cfg, model.parameters())
    ids = first_batch(cfg, mesh)
    step = lambda: optimizer_step(model, optimizer, ids, None, cfg.grad_accum, cfg.clip_norm or None)  # no norm unless clipping
    step()  # step 1 creates the optimizer state
    torch_xla.sync()
    with compiled_hlo() as modules, compiled_hlo(BUFFER_ASSIGNMENT) as buffers:
        step()
        torch_xla.sync()
    state = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    nbytes = lambda ts: sum(math.prod(shard_shape(t)) * t.element_size() for t in ts)
    hlo = "".join(modules)
    return dict(param_bytes=nbytes(model.parameters()), optimizer_bytes=nbytes(state),
                temp_bytes=sum(map(temp_bytes, buffers)), matmuls=op_count(hlo, "dot"),
                collectives=collectives(hlo))


mesh_arg = int_list("4,2 (data, model)")  # --mesh 4,2 -> (4, 2)
names = lambda text: tuple(t.strip() for t in text.split(","))  # --lora-targets q_proj,v_proj -> ('q_proj', 'v_proj')


def field_help():
    """{field: its comment in TrainConfig's source}: the CLI's help lines, written once."""
    lines = inspect.getsource(TrainConfig).splitlines()
    return {m[1]: m[2] for m in (re.match(r"\s+(\w+):[^#]*#\s*(.*)", line) for line in lines) if m}


def _parse_args(argv=None):
    """One --flag per TrainConfig field: --mesh 4,2, --steps 300, --resume, ...; and --debug."""
    parser = ArgumentParser(prog="python -m llama_xla_helpers.train", description=__doc__.split("\n")[0])
    helps = field_help()
    for f in dataclasses.fields(TrainConfig):  # the formatter adds "(default: ...)"; a None's comment says what it does
        flag, help = "--" + f.name.replace("_", "-"), helps.get(f.name, "").replace("None: ", "default: ")
        if f.type is bool:  # a default of None (decided later) has --no-<flag> as well
            action = "store_true" if f.default is False else BooleanOptionalAction
            parser.add_argument(flag, action=action, default=f.default, help=help)
        elif f.type is tuple:  # --mesh 4,2; --lora-targets q_proj,v_proj
            parser.add_argument(flag, type=mesh_arg if f.name == "mesh" else names, default=f.default, help=help)
        else:
            parser.add_argument(flag, type=f.type, default=f.default, help=help)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an input error")
    args = vars(parser.parse_args(argv))
    return TrainConfig(**{k: v for k, v in args.items() if k != "debug"}), args["debug"]


def main(argv=None):
    cfg, debug = _parse_args(argv)
    with user_errors(debug):
        result = train(dataclasses.replace(cfg, progress=True))
    if xr.process_index() != 0:
        return
    step, val = max(result.val_losses.items())
    if not result.losses:
        print(f"the run is already complete: the newest checkpoint is at step {step} (--steps {cfg.steps}); "
              f"held-out loss {val:.3f} nats/byte")
        return
    if result.stopped_early:
        print(f"stop signal (SIGTERM or SIGHUP): saved a checkpoint at step {step}; resume with --resume")
    print(f"step {step}: train loss {result.losses[max(result.losses)]:.3f}, held-out loss {val:.3f} nats/byte; "
          f"{result.train_compiles} training graphs compiled; attention: {result.attention}")
    if cfg.compile_cache:
        print(f"compile cache: {compile_cache_summary(compile_cache_counters())}")
    if result.tokens_per_sec_per_chip is None:
        print("tokens/s/chip: not enough steps to measure (the first two compile)")
        return
    print(f"{result.tokens_per_sec_per_chip:,.0f} tokens/s/chip", end="; ")
    if result.mfu is None:
        print("MFU not reported: this is not a TPU, and a CPU standing in for one has no meaningful "
              "peak FLOP/s (its speed says nothing about a TPU's)")
    else:
        print(f"MFU {result.mfu:.1%} of {chip()} bf16 peak")


if __name__ == "__main__":
    main()
