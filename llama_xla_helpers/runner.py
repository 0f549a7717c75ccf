"""The engine's model runner: the device state (every layer's KV cache in pages, each slot's newest
token), the one program that advances it, and reading its results (vLLM v1's GPUModelRunner /
TPUModelRunner split, in small). `Generator` uses the fixed-slot caches of the same module.

A step (`step_program`) runs the tokens the scheduler planned, of every request in it, on one
flat axis: prompt chunks and decoded tokens together, each with its position in its own sequence.
Each layer writes the step's keys and values into the pages their requests' block tables name
(`attention.write_pages`, or `write_heads` off a TPU) and attends over them (torch_xla's ragged
paged attention kernel on a TPU, `attention.flat_attention` elsewhere); the LM head runs at
each sequence's last token only, and a token is sampled per sequence in the same program. A
decode step's input is the token the step before sampled, which the host has not read yet: it
stays on the device (`last`, one row per slot) and the step takes it from there (`from_last`).
The host lays the step out (`ragged_layout`, `ModelRunner.inputs`) in a few shapes: T tokens, P
pages (per block table for the kernel, in all for the flat path) and, for a step the flat path
splits in two, C pages of its prompt chunks, each rounded up to a bucket, so after warm-up nothing
compiles, and hands it over in two transfers, one of integers (the grammar's token bitmask
among them) and one of floats (`packed`), which the program slices.

The step takes the pages as arguments and returns the new ones (`PagedCache` writes out of place).
That is what makes a torch.compile'd program update them in place: XLA writes an output into an
input's buffer when the input is donated (`torch.ops.xla.dynamo_set_buffer_donor_`, set before each
call: the mark does not carry over to the outputs), and the runner keeps the outputs as the pages.
Written in place inside the compiled function instead, torch_xla's openxla bridge returns the
written tensors and copies each back into its input after every call, a full copy of every cache
per step (measured: `tests/test_engine.py::test_every_program_writes_the_kv_caches_in_place`). With
lazy tensors (compile=False) the runner `copy_`s the returned pages into the ones it passed, which
only rebinds the pending graph, so the next sync updates each buffer in place, as an in-place op
would. `Caches` does the same for `Generator`'s fixed-slot caches.

Sources: vLLM v1's model runners, https://github.com/vllm-project/vllm (vllm/v1/worker/); torch_xla's
`dynamo_set_buffer_donor_`, https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/_internal/custom_kernel.py#L35-L48,
and its use under torch.compile, https://github.com/pytorch/xla/blob/v2.9.0/test/dynamo/test_dynamo_aliasing.py
"""
import functools
import itertools
import math

import torch
import torch.nn as nn
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from .attention import NO_KEY, RaggedBatch, flat_attention, kernel_attention, uses_kernel, write_heads, write_pages
from .kv_pages import pages_for
from .metrics import kernel_head_dim
from .mesh import make_mesh
from .sampling import adjusted, logprobs_of, sample_rows
from .scheduler import LOGIT_BIAS_MAX
from .sharding import Constraint, to_sharded


def pages_read(runs, page_size):
    """The pages a step's runs (block table, start, n) read, in order, each with the position of its
    first key ({page: position}; a page two sequences share, a cached prefix, sits at the same
    position in both): every run's, and those of the runs of more than one token (prompt chunks)."""
    every, chunks = {}, {}
    for table, start, n in runs:
        for j, page in enumerate(table[:pages_for(start + n, page_size)]):
            every.setdefault(page, j * page_size)
            if n > 1:
                chunks.setdefault(page, j * page_size)
    return every, chunks


def ragged_layout(runs, page_size, tokens, seqs, pages, keys=None, chunk=None, pool=None):
    """A ragged step's layout, host lists for `attention.RaggedBatch`: runs (block table, start, n),
    one per sequence (positions start .. start + n - 1 of it go through the model), on a flat axis
    of `tokens` (T) for `seqs` (S) sequences whose block tables are padded to `pages` (P). keys
    (K): the flat path's keys too, the distinct pages of the block tables (`pages_read`), padded to
    K; if K is `pool`, the pool's page count, every page of the pool in order instead (read in
    place), NO_KEY for those the step does not read. chunk (C): the step split in two
    (`attention.flat_attention`), the flat index of each one-token run's query (padded to S) and
    the pages of the other runs, padded to C."""
    out = dict(kv_lens=[], page_indices=[], cu_q_lens=[0], num_seqs=[len(runs)], positions=[], slots=[],
               token_seq=[])
    for i, (table, start, n) in enumerate(runs):
        out["kv_lens"].append(start + n)
        out["page_indices"].append(table + [0] * (pages - len(table)))
        out["cu_q_lens"].append(out["cu_q_lens"][-1] + n)
        out["positions"] += range(start, start + n)
        out["slots"] += [table[p // page_size] * page_size + p % page_size for p in range(start, start + n)]
        out["token_seq"] += [i] * n
    every, chunks = pages_read(runs, page_size)
    used = out["cu_q_lens"][-1]
    if used > tokens or len(runs) > seqs or keys is not None and len(every) > keys or \
            chunk is not None and len(chunks) > chunk:
        raise ValueError(f"{used} tokens of {len(runs)} sequences do not fit a step of {tokens} tokens, {seqs} "
                         f"sequences, {keys} pages and {chunk} pages of prompt chunks")
    if keys is not None and keys == pool:
        out["key_pages"], out["key_start"] = list(range(pool)), [every.get(page, NO_KEY) for page in range(pool)]
    elif keys is not None:
        out["key_pages"], out["key_start"] = list(every), list(every.values())
    if chunk is not None:
        out["decode"] = [first for first, (_, _, n) in zip(out["cu_q_lens"], runs) if n == 1]
        out["chunk_pages"], out["chunk_start"] = list(chunks), list(chunks.values())
    for name, pad, n in (("kv_lens", 0, seqs), ("page_indices", [0] * pages, seqs), ("cu_q_lens", used, seqs + 1),
                         ("positions", 0, tokens), ("slots", 0, tokens), ("token_seq", 0, tokens),
                         ("key_pages", 0, keys), ("key_start", NO_KEY, keys), ("decode", 0, seqs),
                         ("chunk_pages", 0, chunk), ("chunk_start", NO_KEY, chunk)):
        if name in out:
            out[name] += [pad] * (n - len(out[name]))
    return out


class SlotCache(nn.Module):
    """Stands in for a layer's `model.KVCache` inside a runner program: `k`, `v` (slots,
    max_seq_len, n_kv_heads, head_dim) are the caches handed in, `rows` (R,) the slots of the
    program's R batch rows (None: the first R, in order). `update` writes out of place and keeps the
    results, for the program to return."""

    def __init__(self):
        super().__init__()
        self.k = self.v = self.rows = None

    def update(self, input_pos, k, v):
        """Write k, v (R, seqlen, n_kv_heads, head_dim) at cache positions input_pos, (seqlen,) or
        (R, seqlen), of rows `rows`; return those rows of the new caches."""
        rows = torch.arange(k.shape[0], device=k.device) if self.rows is None else self.rows  # (R,)
        pos = input_pos.expand(k.shape[0], -1) if input_pos.dim() == 1 else input_pos  # (R, seqlen)
        self.k = self.k.index_put((rows[:, None], pos), k)  # (slots, max_seq_len, n_kv_heads, head_dim)
        self.v = self.v.index_put((rows[:, None], pos), v)
        if self.rows is not None:
            return self.k.index_select(0, rows), self.v.index_select(0, rows)  # (R, max_seq_len, ...)
        if k.shape[0] < self.k.shape[0]:  # fewer rows than the caches: the first ones
            return self.k[:k.shape[0]], self.v[:k.shape[0]]
        return self.k, self.v


def attach(views, caches, rows=None):
    for view, (k, v) in zip(views, caches):
        view.k, view.v, view.rows = k, v, rows


class Caches:
    """A model's KV caches as the inputs and outputs of programs (module docstring): `run`
    launches a program and keeps the caches it returns. `Generator` and `ModelRunner` use it."""

    def __init__(self, model, compile):
        self.model, self.compile = model, compile
        self.kv = [layer.self_attn.kv_cache for layer in model.layers]  # the model's own: they hold the caches
        self.views = [SlotCache() for _ in self.kv]

    def tensors(self):
        """Every layer's (k, v), each (max_batch_size, max_seq_len, n_kv_heads, head_dim)."""
        return [(kv.k_cache, kv.v_cache) for kv in self.kv]

    def run(self, program, *args, **kwargs):
        """program(model, views, caches, *args, **kwargs) -> (*outputs, caches): launch it (compiled,
        or traced and synced), keep the caches it returns, and return its outputs (device tensors;
        nothing waits for them)."""
        caches = self.tensors()
        if self.compile:  # XLA may write the outputs into these buffers: the caches are updated in place
            for t in itertools.chain(*caches):
                torch.ops.xla.dynamo_set_buffer_donor_(t, True)
        for layer, view in zip(self.model.layers, self.views):
            layer.self_attn.kv_cache = view
        try:
            *out, caches = program(self.model, self.views, caches, *args, **kwargs)
        finally:
            for layer, kv, view in zip(self.model.layers, self.kv, self.views):
                layer.self_attn.kv_cache, view.k, view.v, view.rows = kv, None, None, None
        for kv, (k, v) in zip(self.kv, caches):
            if self.compile:  # outputs in the donated inputs' buffers
                kv.k_cache, kv.v_cache = k, v
            else:  # lazy: rebinds the pending graph to the caches passed in, which the sync updates in place
                kv.k_cache.copy_(k)
                kv.v_cache.copy_(v)
        del caches, k, v  # a reference alive at the sync would be one more output: a copy of that cache
        if not self.compile:
            torch_xla.sync()  # launch the traced graph
        return out


def default_compile(engine=True):
    """Whether a program compiles when not told (compile=None): `Engine`'s on every device, the
    path the serving benchmark measures faster (on the CPU too: `engine.py` gives the numbers);
    `Generator`'s (engine=False) on a TPU only, where a step takes milliseconds and tracing it
    every token would dominate (off a TPU a call makes a few dozen tokens per shape, which end
    sooner traced than after Dynamo traces each shape first)."""
    return engine or xr.device_type() == "TPU"


def compiled(fn, shapes):
    """`torch.compile(fn, backend="openxla")` for a step traced once per shape (`shapes` of them),
    with graphs of its own.

    Dynamo keeps one cache per function for the whole process and hands a model's weights to the
    graph as inputs, so a graph traced for one model would pass its guards for another of the same
    shapes. But torch_xla's bridge may keep an input as a constant of the graph (`put_replicated`):
    measured here, a second model's decode steps ran the first one's weights. A backend of its own
    per call keeps Dynamo from sharing graphs between calls (it keys its cache by backend), so each
    Generator or runner traces its shapes again; each adds them to the recompile limit (past it,
    Dynamo would run the function uncompiled, silently), and running out raises instead."""
    config = torch._dynamo.config
    config.recompile_limit += shapes
    config.accumulated_recompile_limit += shapes
    config.fail_on_recompile_limit_hit = True
    openxla = torch._dynamo.lookup_backend("openxla")
    return torch.compile(fn, backend=lambda gm, inputs: openxla(gm, inputs), fullgraph=True, dynamic=False)


def mark_replicated(model):
    """Give every tensor of an unsharded model on the XLA device a 'replicated' sharding now.

    torch_xla gives them that sharding after the first execution anyway. Marked only then, the
    second call's graph differs: a bf16 model's norm weights feed a `convert` that now carries
    `sharding={replicated}`, so the prefill graph hashes differently and compiles once more.
    """
    mesh = make_mesh()
    for t in list(model.parameters()) + list(model.buffers()):
        xs.mark_sharding(t, mesh, (None,) * t.dim())


def put_replicated(t, mesh):
    """A host tensor on the device as a program's input, annotated 'replicated' on `mesh` as data
    (not as a graph op, which would make its first use a different graph from its later ones).

    On a one-device mesh too: torch_xla's dynamo bridge compares each call's input shardings with
    the last call's, and an input without one (which becomes 'replicated' once synced) sends every
    call through its graph extraction again, about 10 ms of host time per step (measured).

    Put an input afresh for every program that reads it, unless a program made it: the bridge
    matches a graph's inputs to the call's arguments by the id stamped on each device buffer, and a
    tensor that was an argument while one graph compiled carries another id when the next one
    compiles, which then keeps it as a constant: every later call reads the traced value (measured
    here with `Generator`'s padding; found in https://github.com/tenstorrent/tt-xla/issues/6019)."""
    t = t.to(torch_xla.device())
    xs.mark_sharding(t, mesh, (None,) * t.dim())
    return t


def replicator(model):
    """On a sharded model (`model.mesh`), a function that pins a 1-D to 3-D tensor to 'replicated'.

    The step's inputs are replicated; pinning its outputs too gives every step the same
    input shardings (one graph) and lets the host read them without a gather.
    """
    mesh = getattr(model, "mesh", None)
    if mesh is None:
        return lambda t: t
    constraints = {n: Constraint("generation state", mesh, (None,) * n) for n in (1, 2, 3)}
    return lambda t: constraints[t.dim()](t)


class PagedCache(nn.Module):
    """A layer's KV cache in the engine, in place of the model's `KVCache`: inside a step, `pages` are
    the pages handed in and `batch` the step's `attention.RaggedBatch`. `attend` writes the step's
    keys and values into their pages, out of place, keeping the result for the step to return, and
    attends over them: with the ragged kernel if `kernel` (`attention.uses_kernel`; pages in its
    layout, `attention.write_pages`), else the flat path (`attention.flat_attention`; pages heads
    first, `attention.write_heads`)."""

    def __init__(self, mesh, kernel):
        super().__init__()
        self.mesh = "" if mesh is None else str(mesh)  # the kernel's op takes the mesh as a string
        self.kernel, self.pages, self.batch = kernel, None, None

    def attend(self, q, k, v, scale):
        """q (T, n_heads, head_dim), k, v (T, n_kv_heads, head_dim) -> (T, n_heads, head_dim)."""
        if self.kernel:
            self.pages = write_pages(self.pages, self.batch, k, v)
            return kernel_attention(q, self.pages, self.batch, scale, self.mesh)
        self.pages = write_heads(self.pages, self.batch, k, v)
        return flat_attention(q, self.pages, self.batch, scale)


def packed(fields, put, dtype):
    """fields {name: a host list, a list of equal lists (2-D), a host tensor, or None: left out} as
    one device tensor of dtype (one transfer, `put`) and its layout ((name, shape), ...), which
    `unpacked` slices back inside the program."""
    parts, flat, layout = [], [], []
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            parts += [torch.tensor(flat, dtype=dtype), value.flatten().to(dtype)]
            flat = []
            layout.append((name, tuple(value.shape)))
        elif value is not None:
            rows = value and isinstance(value[0], list)
            flat += itertools.chain.from_iterable(value) if rows else value
            layout.append((name, (len(value), len(value[0])) if rows else (len(value),)))
    return put(torch.cat(parts + [torch.tensor(flat, dtype=dtype)])), tuple(layout)


def unpacked(flat, layout):
    """{name: tensor} from one of `packed`'s tensors (on the device: views, no transfer)."""
    sizes = [math.prod(shape) for _, shape in layout]
    return {name: part.view(shape) for (name, shape), part in zip(layout, flat.split(sizes))}


GREEDY_ROWS = 16  # the fewest sampler rows whose steps have an argmax variant (`ModelRunner.greedy_at`)
KERNEL_ARGS = RaggedBatch._fields[:4]  # int32 on the device: the kernel's JAX side takes int32


def step_program(model, views, pages, pin, last, counts, bias, ints, floats, layout, greedy=False, eos=()):
    """One ragged step (`Llama.ragged`): the tokens of every request it runs on one flat axis.

    ints, floats: the step's inputs, each packed in one tensor (`packed`; layout: their names and
    shapes). Per token (T,): tokens, the host's input tokens; from_last, the slot whose newest
    token, `last[slot]` on the device, is the input instead (-1: the host's token); targets, the
    next prompt token at each position, for the prompt's log-probabilities (absent: not asked);
    generated, 1 for a token its request generated (counted for the penalties). Per sequence (S,):
    logits_at (its last token on the flat axis), slot (its request's, or the spare last row for
    padding), fresh (1: its request was admitted this step), write_to (its slot, or the spare row
    when it samples nothing: a prompt chunk before its last), seed, top_k, no_eos (1: the `eos`
    ids may not be sampled, a request short of its min_tokens), temperature, top_p, presence and
    frequency (penalties). Per logit_bias entry written this step (LOGIT_BIAS_MAX, padded with
    zeros at the spare row): bias_rows, bias_ids, bias_values. Then the fields of
    `attention.RaggedBatch`, and bitmask (slots + 1, ceil(vocab_size / 32)): each slot's grammar's
    allowed tokens for this step (`sampling.allowed_by`; -1, every token, for the others).

    State per slot, (slots + 1, vocab_size) each, updated here and returned: counts (int32, the
    times its request generated each token: a fresh request's row is zeroed, then every generated
    input token is added; the token sampled here is counted when it runs as an input), bias
    (fp32, its request's logit_bias: zeroed for a fresh request, then the entries written). A
    sequence samples from `sampling.adjusted` logits of its `write_to` row. greedy: every sequence
    that samples is greedy and none asks for log-probabilities, so the program is an argmax (a
    variant of its own: no top-k over the vocabulary, no log-softmax). eos: the model's EOS ids (a
    constant of the program).

    Returns (a sampled token per sequence (S,), their `logprobs_of` (of the model's logits, before
    any adjustment or mask) or None if greedy, the prompt's `logprobs_of` (T, ...) or None, last,
    counts, bias, pages)."""
    x = unpacked(ints, layout[0]) | unpacked(floats, layout[1])
    batch = RaggedBatch(*(x[k].int() if k in KERNEL_ARGS and k in x else x.get(k) for k in RaggedBatch._fields))
    tokens = torch.where(x["from_last"] >= 0, last[x["from_last"].clamp(min=0)], x["tokens"])  # (T,)
    rows, keep = x["slot"], 1 - x["fresh"][:, None]  # (S,), (S, 1)
    counts = counts.index_put((rows,), counts[rows] * keep.to(counts.dtype))  # (slots + 1, vocab_size)
    counts = counts.index_put((rows[x["token_seq"]], tokens), x["generated"].to(counts.dtype), accumulate=True)
    bias = bias.index_put((rows,), bias[rows] * keep)  # (slots + 1, vocab_size)
    bias = bias.index_put((x["bias_rows"], x["bias_ids"]), x["bias_values"])
    for view, p in zip(views, pages):
        view.pages, view.batch = p, batch
    targets, logits_at = x.get("targets"), x["logits_at"]
    logits = model.ragged(tokens, batch.positions, None if targets is not None else logits_at)  # (S or T, vocab_size)
    prompt = None if targets is None else tuple(map(pin, logprobs_of(logits, targets)))
    logits = logits if targets is None else logits[logits_at]  # (S, vocab_size)
    pos = batch.positions[logits_at]  # (S,) the position each samples from
    row = x["write_to"]
    allowed = x["bitmask"].int()[row]  # (S, ceil(vocab_size / 32))
    masked = adjusted(logits, bias[row], counts[row], x["presence"], x["frequency"], allowed)  # (S, vocab_size)
    if eos:
        is_eos = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        is_eos[list(eos)] = True  # (vocab_size,)
        masked = masked.masked_fill((x["no_eos"][:, None] > 0) & is_eos, float("-inf"))
    if greedy:
        nxt, lp = masked.argmax(dim=-1), None  # (S,): what sample_rows gives at temperature 0
    else:
        nxt = sample_rows(masked, x["temperature"], x["top_p"], x["seed"], pos, x["top_k"])  # (S,)
        lp = tuple(map(pin, logprobs_of(logits, nxt)))
    last = last.index_copy(0, x["write_to"], nxt)  # (slots + 1,)
    pages = [v.pages for v in views]
    for view in views:  # left set, each would be one more output the compiled call rebuilds every step
        view.pages = view.batch = None
    return pin(nxt), lp, prompt, pin(last), pin(counts), pin(bias), pages


def growing(first, last, factor):
    """first, factor x first, factor^2 x first, ... up to last (included): e.g. (8, 32, 96) for 8, 96
    and 4."""
    out = [first]
    while out[-1] < last:
        out.append(min(factor * out[-1], last))
    return tuple(out)


def round_up(n, sizes):
    return next(k for k in sizes if k >= n)


class ModelRunner:
    """The device side of `engine.Engine` over a `Llama` (moved to the XLA device if on the CPU;
    or sharded by `parallel.shard_for_inference`): every layer's KV cache becomes a pool of
    `num_pages` pages of `page_size` positions (the model's own fixed-slot caches are dropped), and
    `step` launches `step_program`, compiled with torch.compile(backend="openxla") if `compile`,
    else traced as lazy tensors at every call.

    The pool's layout follows the attention that reads it: the ragged kernel's on a TPU
    (`attention.write_pages`), K and V apart, each heads first, elsewhere (`attention.write_heads`,
    read by `attention.flat_attention`). Shapes: T tokens (`token_buckets`, the largest the step's
    budget), S = min(T, slots) sequences (the LM head and the sampler run on S rows), and P pages
    (`page_buckets`): the kernel reads each sequence's kv length and takes one P per block table,
    a whole context's; the flat path gathers the step's pages, P of them in all, from 8 growing 4x
    (few programs: each compiles in about 4 s on the CPU) up to what min(T, slots) whole contexts
    hold, the largest the whole pool, read in place (`attention.keys_attention`). Each (T, P) has
    the sampler's program; decode-sized steps an argmax one too (`greedy_at`, `step_program`); and
    on the flat path, steps with a prompt chunk beside decoding requests one per chunk-page bucket
    C < P, split in two (`splits`, `attention.flat_attention`). A step with prompt
    log-probabilities runs at the largest (one more program)."""

    def __init__(self, model, slots, num_pages, page_size, token_buckets, compile, eos=()):
        self.device = torch_xla.device()
        self.model = model if model.embed_tokens.weight.device.type == "xla" else model.to(self.device)
        if getattr(self.model, "mesh", None) is None:
            mark_replicated(self.model)
        self.mesh = getattr(self.model, "mesh", None) or make_mesh()
        self.put = functools.partial(put_replicated, mesh=self.mesh)  # a host tensor, a step's input
        self.pin = replicator(self.model)
        args, dtype = self.model.args, self.model.embed_tokens.weight.dtype
        self.slots, self.page_size, self.token_buckets = slots, page_size, tuple(token_buckets)
        self.kernel = uses_kernel(args.n_kv_heads, dtype, getattr(self.model, "mesh", None))
        self.views = [PagedCache(getattr(self.model, "mesh", None), self.kernel) for _ in self.model.layers]
        for layer, view in zip(self.model.layers, self.views):
            layer.self_attn.kv_cache = view  # the model's fixed-slot caches go: the pages replace them
        heads = "model" if "model" in self.mesh.axis_names else None
        if self.kernel:  # the kernel's head_dim: padded to 128
            shape = (num_pages, page_size, 2 * args.n_kv_heads, kernel_head_dim(args.head_dim))
            spec = (None, None, heads, None)
        else:
            shape, spec = (2, args.n_kv_heads, num_pages, page_size, args.head_dim), (None, heads, None, None, None)
        self.pages = [to_sharded(lambda index: torch.zeros([s.stop - s.start for s in index], dtype=dtype),
                                 self.mesh, spec, shape) for _ in self.model.layers]
        self.last = self.put(torch.zeros(slots + 1, dtype=torch.long))  # each slot's newest token; a spare row
        # Each slot's counts of its request's generated tokens and its logit_bias (`step_program`), and on the host the
        # grammar bitmask of a step with no grammar: every bit set, in the step's integer dtype (`inputs`)
        self.counts = self.put(torch.zeros(slots + 1, args.vocab_size, dtype=torch.int32))
        self.bias = self.put(torch.zeros(slots + 1, args.vocab_size))
        self.any_token = torch.full((slots + 1, -(-args.vocab_size // 32)), -1, dtype=torch.long)
        self.whole = pages_for(args.max_seq_len, page_size)  # a whole context's block table
        self.num_pages = num_pages  # the flat path's largest key bucket: the whole pool, read in place
        self.page_buckets = (self.whole,) if self.kernel else growing(8, num_pages, 4)
        self.compile, self.eos = compile, tuple(eos)  # eos: the ids min_tokens masks
        self.program = compiled(step_program, len(self.shapes())) if compile else step_program

    def most_pages(self, tokens):
        """The largest P a step of `tokens` tokens can need: min(tokens, slots) whole contexts."""
        return self.whole if self.kernel else \
            round_up(min(min(tokens, self.slots) * self.whole, self.page_buckets[-1]), self.page_buckets)

    def greedy_at(self, tokens):
        """Whether steps of `tokens` tokens have the argmax variant: those of at most `slots` tokens
        (larger ones carry a prompt chunk, whose MLP outweighs the sampler) with 16 or more sampler
        rows (measured on the CPU, 8 layers: 4.5 of 36 ms at 16 rows, 7 of 75 at 32, nothing at 4)."""
        return GREEDY_ROWS <= tokens <= self.slots

    def splits(self, tokens):
        """Whether steps of `tokens` tokens have programs split in two (`attention.flat_attention`): on
        the flat path, with more tokens than `slots` (so a prompt chunk), and room for a decoding
        request beside it."""
        return not self.kernel and tokens > self.slots > 1

    def shapes(self):
        """The (T, P, C, prompt log-probabilities, greedy) each step runs at: every (T, P) a step can
        need with the sampler in one group (C = 0), the argmax variant where it has one (`greedy_at`),
        each (T, P) that `splits` split in two with its chunks' pages C < P, and the largest (T, P)
        with prompt log-probabilities."""
        pairs = [(t, p) for t in self.token_buckets for p in self.page_buckets if p <= self.most_pages(t)]
        split = [(t, p, c) for t, p in pairs if self.splits(t) for c in self.page_buckets if c < p]
        return [(t, p, 0, False, False) for t, p in pairs] + \
            [(t, p, 0, False, True) for t, p in pairs if self.greedy_at(t)] + \
            [(t, p, c, False, False) for t, p, c in split] + [(*pairs[-1], 0, True, False)]

    def shape(self, entries, echo):
        """The (T, P, C) a step of these entries runs at: C, its chunks' pages when it is split (more
        tokens than `slots` and fewer chunk pages than P, in buckets), else 0."""
        if echo:
            return self.shapes()[-1][:3]
        t = round_up(sum(n for _, _, n, _ in entries), self.token_buckets)
        if self.kernel:
            return t, self.whole, 0
        every, chunks = pages_read([(r.pages, start, n) for r, start, n, _ in entries], self.page_size)
        p, c = round_up(len(every), self.page_buckets), round_up(len(chunks), self.page_buckets)
        return t, p, c if self.splits(t) and c < p else 0

    def inputs(self, entries, echo, t, p, c):
        """The host side of a step: the plan's entries (request, start, n, samples) as step_program's
        inputs, at T = t tokens, P = p pages (per block table for the kernel, in all for the flat
        path) and C = c pages of prompt chunks (0: not split), in two transfers."""
        seqs = min(t, self.slots)
        runs = [(r.pages, start, n) for r, start, n, _ in entries]
        layout = ragged_layout(runs, self.page_size, t, seqs, self.whole, None if self.kernel else p, c or None,
                               self.num_pages)
        tokens, from_last, targets, generated = [0] * t, [-1] * t, [0] * t, [0] * t
        for (req, start, n, _), first in zip(entries, layout["cu_q_lens"]):
            known = req.known_tokens(start, start + n)
            for i, pos in enumerate(range(start, start + n), first):
                if pos - start < len(known):
                    tokens[i] = known[pos - start]
                else:  # its newest token, made by the step before, not read yet
                    from_last[i] = req.slot
                if pos + 1 < len(req.prompt):
                    targets[i] = req.prompt[pos + 1]
                generated[i] = int(pos >= len(req.prompt))
        s = seqs - len(entries)  # the sequences past the plan's: nothing
        fresh = [int(start == r.cached_tokens) for r, start, _, _ in entries]  # admitted this step (`Scheduler.admit`)
        writes = [(r.slot, i, v) for (r, *_), new in zip(entries, fresh) if new for i, v in r.logit_bias.items()]
        if len(writes) > LOGIT_BIAS_MAX:  # the scheduler admits no more
            raise ValueError(f"{len(writes)} logit_bias entries in one step, more than LOGIT_BIAS_MAX={LOGIT_BIAS_MAX}")
        writes += [(self.slots, 0, 0.0)] * (LOGIT_BIAS_MAX - len(writes))
        ints = dict(tokens=tokens, from_last=from_last, targets=targets if echo else None, generated=generated,
                    logits_at=[end - 1 for end in layout["cu_q_lens"][1:len(entries) + 1]] + [0] * s,
                    slot=[r.slot for r, *_ in entries] + [self.slots] * s, fresh=fresh + [0] * s,
                    write_to=[r.slot if samples else self.slots for r, _, _, samples in entries] + [self.slots] * s,
                    seed=[r.seed for r, *_ in entries] + [0] * s, top_k=[r.top_k for r, *_ in entries] + [0] * s,
                    no_eos=[int(start + n - len(r.prompt) < r.min_tokens) for r, start, n, _ in entries] + [0] * s,
                    bias_rows=[w[0] for w in writes], bias_ids=[w[1] for w in writes], **layout,
                    bitmask=self.bitmask(entries))
        floats = dict(temperature=[r.temperature for r, *_ in entries] + [0.0] * s,
                      top_p=[r.top_p for r, *_ in entries] + [1.0] * s,
                      presence=[r.presence_penalty for r, *_ in entries] + [0.0] * s,
                      frequency=[r.frequency_penalty for r, *_ in entries] + [0.0] * s,
                      bias_values=[w[2] for w in writes])
        (ints, int_layout), (floats, float_layout) = packed(ints, self.put, torch.long), \
            packed(floats, self.put, torch.float32)
        return ints, floats, (int_layout, float_layout)

    def bitmask(self, entries):
        """The step's grammar bitmask on the host: each sampling request's grammar fills its slot's
        row (xgrammar's `fill_next_token_bitmask`: its matcher has every token so far, the engine
        reads them first), every other bit is set. Sent with the step's integers (`inputs`), as int64:
        a step with no grammar sends `any_token` as it is."""
        constrained = [r for r, _, _, samples in entries if samples and r.grammar is not None]
        if not constrained:
            return self.any_token
        mask = self.any_token.int()  # xgrammar fills int32
        for r in constrained:
            r.grammar.fill_next_token_bitmask(mask, r.slot)
        return mask.long()

    def step(self, entries, echo=False, shape=None, greedy=None):
        """Launch one step for the plan's entries; returns its device outputs (a token per sequence
        (S,), their logprobs or None, the prompt's logprobs per flat token or None). echo: compute the
        prompt's log-probabilities. shape: (T, P, C) instead of `self.shape(entries, echo)`, and greedy:
        the program variant instead of the entries' (warm-up)."""
        shape = shape or self.shape(entries, echo)
        if greedy is None:  # every entry that samples at temperature 0 and without log-probabilities
            greedy = not echo and self.greedy_at(shape[0]) and all(
                r.temperature == 0 and r.logprobs is None for r, _, _, samples in entries if samples)
        state = [self.last, self.counts, self.bias]
        if self.compile:  # XLA may write the new pages, tokens, counts and biases into these buffers: in place
            for t in self.pages + state:
                torch.ops.xla.dynamo_set_buffer_donor_(t, True)
        try:
            *out, last, counts, bias, pages = self.program(self.model, self.views, self.pages, self.pin, *state,
                                                           *self.inputs(entries, echo, *shape), greedy, self.eos)
        finally:
            for view in self.views:
                view.pages = view.batch = None  # a reference alive at the sync would be one more output
        if self.compile:  # the outputs live in the donated inputs' buffers
            self.pages, self.last, self.counts, self.bias = pages, last, counts, bias
        else:  # lazy: rebinds the pending graph to the tensors passed in, which the sync updates in place
            for old, new in zip(self.pages + state, pages + [last, counts, bias]):
                old.copy_(new)
            del pages, last, counts, bias, new
            torch_xla.sync()
        return out

    @staticmethod
    def read(outputs):
        """Device outputs as host tensors (this waits for the programs that make them)."""
        return None if outputs is None else tuple(t.cpu() for t in outputs)
