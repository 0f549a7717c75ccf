"""The engine's model runner: the device state (every layer's KV cache in pages, each slot's newest
token), the one program that advances it, and reading its results (vLLM v1's GPUModelRunner /
TPUModelRunner split, in small). `Generator` uses the fixed-slot caches of the same module.

A step (`step_program`) runs the tokens the scheduler planned, of every request in it, on one
flat axis: prompt chunks and decoded tokens together, each with its position in its own sequence.
Each layer writes the step's keys and values into the pages their requests' block tables name
(`attention.write_pages`) and attends over them (`attention.ragged_attention`: torch_xla's ragged
paged attention kernel on a TPU, a fixed-shape gather-and-mask elsewhere); the LM head runs at
each sequence's last token only, and a token is sampled per sequence in the same program. A
decode step's input is the token the step before sampled, which the host has not read yet: it
stays on the device (`last`, one row per slot) and the step takes it from there (`from_last`).
The host lays the step out (`ragged_layout`, `ModelRunner.inputs`) in a few shapes: T tokens and P
pages per block table, each rounded up to a bucket, so after warm-up nothing compiles.

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
buffer donation under torch.compile, https://github.com/pytorch/xla/blob/v2.9.0/docs/source/perf/dynamo.md
"""
import itertools

import torch
import torch.nn as nn
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from .attention import QUERY_BLOCK, gather_attention, kernel_attention, ragged_batch, uses_kernel, write_pages
from .kv_pages import pages_for
from .metrics import kernel_head_dim
from .mesh import make_mesh
from .sampling import logprobs_of, sample_rows
from .sharding import Constraint, to_sharded


def ragged_layout(runs, page_size, tokens, seqs, pages):
    """A ragged step's layout, host lists for `attention.RaggedBatch`: runs (block table, start, n),
    one per sequence (positions start .. start + n - 1 of it go through the model), on a flat axis
    of `tokens` (T) for `seqs` (S) sequences whose block tables are cut or padded to `pages` (P).

    The gather path's query blocks: one token per row when the step has no more tokens than
    sequences (a decode step: R = T rows of 1), else blocks of attention.QUERY_BLOCK tokens of one
    sequence (R = S + T // Qb rows, enough for any split of T tokens among S sequences)."""
    qb = 1 if tokens <= seqs else QUERY_BLOCK
    n_rows = tokens if qb == 1 else seqs + tokens // qb
    out = dict(kv_lens=[], page_indices=[], cu_q_lens=[0], num_seqs=[len(runs)], positions=[], slots=[],
               rows=[], row_seq=[], row_pos=[], unrow=[])
    for i, (table, start, n) in enumerate(runs):
        first = out["cu_q_lens"][-1]
        out["kv_lens"].append(start + n)
        out["page_indices"].append(table + [0] * (pages - len(table)))
        out["cu_q_lens"].append(first + n)
        out["positions"] += range(start, start + n)
        out["slots"] += [table[p // page_size] * page_size + p % page_size for p in range(start, start + n)]
        for b in range(0, n, qb):
            m = min(qb, n - b)
            out["unrow"] += range(len(out["rows"]) * qb, len(out["rows"]) * qb + m)
            out["rows"].append(list(range(first + b, first + b + m)) + [0] * (qb - m))
            out["row_seq"].append(i)
            out["row_pos"].append(list(range(start + b, start + b + m)) + [0] * (qb - m))
    used = out["cu_q_lens"][-1]
    if used > tokens or len(runs) > seqs or len(out["rows"]) > n_rows:
        raise ValueError(f"{used} tokens of {len(runs)} sequences do not fit a step of {tokens} tokens and {seqs} sequences")
    for name, pad, n in (("kv_lens", 0, seqs), ("page_indices", [0] * pages, seqs), ("cu_q_lens", used, seqs + 1),
                         ("positions", 0, tokens), ("slots", 0, tokens), ("unrow", 0, tokens),
                         ("rows", [0] * qb, n_rows), ("row_seq", 0, n_rows), ("row_pos", [0] * qb, n_rows)):
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


def default_compile():
    """Whether `Engine` and `Generator` compile their programs when not told (compile=None): on a
    TPU, where a step takes milliseconds and tracing it again at every step would cost more
    (`engine.py` gives the measured numbers)."""
    return xr.device_type() == "TPU"


def compiled(fn, shapes):
    """`torch.compile(fn, backend="openxla")` for a step traced once per shape (`shapes` of them).

    Dynamo keeps one cache per function for the whole process, and past its recompile limit (8) it
    runs the function uncompiled, silently: a Generator or runner over another model traces its
    shapes again, so each adds its own to the limit, and running out raises instead."""
    config = torch._dynamo.config
    config.recompile_limit += shapes
    config.accumulated_recompile_limit += shapes
    config.fail_on_recompile_limit_hit = True
    return torch.compile(fn, backend="openxla", fullgraph=True, dynamic=False)


def mark_replicated(model):
    """Give every tensor of an unsharded model on the XLA device a 'replicated' sharding now.

    torch_xla gives them that sharding after the first execution anyway. Marked only then, the
    second call's graph differs: a bf16 model's norm weights feed a `convert` that now carries
    `sharding={replicated}`, so the prefill graph hashes differently and compiles once more.
    """
    mesh = make_mesh()
    for t in list(model.parameters()) + list(model.buffers()):
        xs.mark_sharding(t, mesh, (None,) * t.dim())


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
    """A layer's KV cache in the engine, in place of the model's `KVCache`: inside a step, `pages`
    (num_pages, page_size, 2 * n_kv_heads, head_dim) are the pages handed in and `batch` the step's
    `attention.RaggedBatch`. `attend` writes the step's keys and values into their pages, out of
    place, keeping the result for the step to return, and attends over them: with the ragged
    kernel if `kernel` (`attention.uses_kernel`), else the gather path (`attention.gather_attention`)."""

    def __init__(self, mesh, kernel):
        super().__init__()
        self.mesh = "" if mesh is None else str(mesh)  # the kernel's op takes the mesh as a string
        self.kernel, self.pages, self.batch = kernel, None, None

    def attend(self, q, k, v, scale):
        """q (T, n_heads, head_dim), k, v (T, n_kv_heads, head_dim) -> (T, n_heads, head_dim)."""
        self.pages = write_pages(self.pages, self.batch, k, v)
        if self.kernel:
            return kernel_attention(q, self.pages, self.batch, scale, self.mesh)
        return gather_attention(q, self.pages, self.batch, scale)


def step_program(model, views, pages, pin, last, tokens, from_last, batch, seqs, targets=None):
    """One ragged step (`Llama.ragged`): the tokens of every request it runs on one flat axis.

    tokens (T,): the host's input tokens; from_last (T,): the slot whose newest token, `last[slot]`
    on the device, is the input instead (-1: the host's token). seqs, per sequence (S,): logits_at
    (its last token on the flat axis), write_to (its slot, or the spare last row of `last` when it
    samples nothing: a prompt chunk before its last), ints (S, 2) [seed, top_k], floats (S, 2)
    [temperature, top_p]. targets (T,): the next prompt token at each position, for the prompt's
    log-probabilities (None: not asked). Returns (a sampled token per sequence (S,), their
    `logprobs_of`, the prompt's `logprobs_of` (T, ...) or None, last, pages)."""
    logits_at, write_to, ints, floats = seqs
    tokens = torch.where(from_last >= 0, last[from_last.clamp(min=0)], tokens)  # (T,)
    for view, p in zip(views, pages):
        view.pages, view.batch = p, batch
    logits = model.ragged(tokens, batch.positions, None if targets is not None else logits_at)  # (S or T, vocab_size)
    prompt = None if targets is None else tuple(map(pin, logprobs_of(logits, targets)))
    logits = logits if targets is None else logits[logits_at]  # (S, vocab_size)
    pos = batch.positions[logits_at].long()  # (S,) the position each samples from
    nxt = sample_rows(logits, floats[:, 0], floats[:, 1], ints[:, 0], pos, ints[:, 1])  # (S,)
    last = last.index_copy(0, write_to, nxt)  # (slots + 1,)
    return pin(nxt), tuple(map(pin, logprobs_of(logits, nxt))), prompt, pin(last), [v.pages for v in views]


def doubling(first, last):
    """first, 2 first, 4 first, ... up to last (included): e.g. (16, 32, 64, 100) for 16 and 100."""
    out = [first]
    while out[-1] < last:
        out.append(min(2 * out[-1], last))
    return tuple(out)


def round_up(n, sizes):
    return next(k for k in sizes if k >= n)


class ModelRunner:
    """The device side of `engine.Engine` over a `Llama` (moved to the XLA device if on the CPU;
    or sharded by `parallel.shard_for_inference`): every layer's KV cache becomes a pool of
    `num_pages` pages of `page_size` positions (the model's own fixed-slot caches are dropped), and
    `step` launches `step_program`, compiled with torch.compile(backend="openxla") if `compile`,
    else traced as lazy tensors at every call.

    Shapes: T tokens (`token_buckets`, the largest the step's budget) and P pages per block table
    (`page_buckets`: doubling up to a whole context's, so a step whose requests are short reads
    few pages: the gather path's cost; the kernel reads only each sequence's kv length and takes
    one P). A step with prompt log-probabilities runs at the largest of both (one more program)."""

    def __init__(self, model, slots, num_pages, page_size, token_buckets, compile):
        self.device = torch_xla.device()
        self.model = model if model.embed_tokens.weight.device.type == "xla" else model.to(self.device)
        if getattr(self.model, "mesh", None) is None:
            mark_replicated(self.model)
        self.mesh = getattr(self.model, "mesh", None) or make_mesh()
        self.pin = replicator(self.model)
        args, dtype = self.model.args, self.model.embed_tokens.weight.dtype
        self.slots, self.page_size, self.token_buckets = slots, page_size, tuple(token_buckets)
        self.kernel = uses_kernel(args.n_kv_heads, dtype, getattr(self.model, "mesh", None))
        self.views = [PagedCache(getattr(self.model, "mesh", None), self.kernel) for _ in self.model.layers]
        for layer, view in zip(self.model.layers, self.views):
            layer.self_attn.kv_cache = view  # the model's fixed-slot caches go: the pages replace them
        head_dim = kernel_head_dim(args.head_dim) if self.kernel else args.head_dim  # the kernel's: padded to 128
        shape = (num_pages, page_size, 2 * args.n_kv_heads, head_dim)
        spec = (None, None, "model" if "model" in self.mesh.axis_names else None, None)
        self.pages = [to_sharded(lambda index: torch.zeros([s.stop - s.start for s in index], dtype=dtype),
                                 self.mesh, spec, shape) for _ in self.model.layers]
        self.last = self.put(torch.zeros(slots + 1, dtype=torch.long))  # each slot's newest token; a spare row
        whole = pages_for(args.max_seq_len, page_size)
        self.page_buckets = (whole,) if self.kernel else doubling(1, whole)
        self.compile = compile
        self.program = compiled(step_program, len(self.shapes())) if compile else step_program

    def shapes(self):
        """The (T, P, prompt log-probabilities) each step runs at: every pair, and the largest with them."""
        return [(t, p, False) for t in self.token_buckets for p in self.page_buckets] + \
            [(self.token_buckets[-1], self.page_buckets[-1], True)]

    def put(self, t):
        """A host tensor on the device, annotated 'replicated' as data (not as a graph op, which
        would make its first use a different graph from its later ones)."""
        t = t.to(self.device)
        xs.mark_sharding(t, self.mesh, (None,) * t.dim())
        return t

    def shape(self, entries, echo):
        """The (T, P) a step of these entries runs at."""
        if echo:
            return self.token_buckets[-1], self.page_buckets[-1]
        used = sum(n for _, _, n, _ in entries)
        longest = max(pages_for(start + n, self.page_size) for _, start, n, _ in entries)
        return round_up(used, self.token_buckets), round_up(longest, self.page_buckets)

    def inputs(self, entries, echo, t, p):
        """The host side of a step: the plan's entries (request, start, n, samples) as step_program's
        inputs, at T = t tokens and P = p pages per block table."""
        layout = ragged_layout([(r.pages, start, n) for r, start, n, _ in entries], self.page_size, t, self.slots, p)
        tokens, from_last, targets = [0] * t, [-1] * t, [0] * t
        for (req, start, n, _), first in zip(entries, layout["cu_q_lens"]):
            known = req.known
            for i, pos in enumerate(range(start, start + n), first):
                if pos < len(known):
                    tokens[i] = known[pos]
                else:  # its newest token, made by the step before, not read yet
                    from_last[i] = req.slot
                if pos + 1 < len(req.prompt):
                    targets[i] = req.prompt[pos + 1]
        s = self.slots - len(entries)  # the sequences past the plan's: nothing
        logits_at = [c - 1 for c in layout["cu_q_lens"][1:len(entries) + 1]] + [0] * s
        write_to = [r.slot if samples else self.slots for r, _, _, samples in entries] + [self.slots] * s
        ints = [[r.seed, r.top_k] for r, *_ in entries] + [[0, 0]] * s
        floats = [[r.temperature, r.top_p] for r, *_ in entries] + [[0.0, 1.0]] * s
        batch = ragged_batch(layout, self.put)
        seqs = (self.put(torch.tensor(logits_at)), self.put(torch.tensor(write_to)), self.put(torch.tensor(ints)),
                self.put(torch.tensor(floats)))
        return self.put(torch.tensor(tokens)), self.put(torch.tensor(from_last)), batch, seqs, \
            self.put(torch.tensor(targets)) if echo else None

    def step(self, entries, echo=False, shape=None):
        """Launch one step for the plan's entries; returns its device outputs (a token per sequence
        (slots,), their logprobs, the prompt's logprobs per flat token or None). echo: compute the
        prompt's log-probabilities. shape: (T, P) instead of `self.shape(entries, echo)` (warm-up)."""
        if self.compile:  # XLA may write the new pages and tokens into these buffers: updated in place
            for t in self.pages + [self.last]:
                torch.ops.xla.dynamo_set_buffer_donor_(t, True)
        try:
            *out, last, pages = self.program(self.model, self.views, self.pages, self.pin, self.last,
                                             *self.inputs(entries, echo, *(shape or self.shape(entries, echo))))
        finally:
            for view in self.views:
                view.pages = view.batch = None  # a reference alive at the sync would be one more output
        if self.compile:  # the outputs live in the donated inputs' buffers
            self.pages, self.last = pages, last
        else:  # lazy: rebinds the pending graph to the tensors passed in, which the sync updates in place
            for old, new in zip(self.pages + [self.last], pages + [last]):
                old.copy_(new)
            del pages, last, new
            torch_xla.sync()
        return out

    @staticmethod
    def read(outputs):
        """Device outputs as host tensors (this waits for the programs that make them)."""
        return None if outputs is None else tuple(t.cpu() for t in outputs)
