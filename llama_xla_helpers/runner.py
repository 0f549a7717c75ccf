"""The engine's model runner: the device state of every slot, the two programs that advance it,
and reading their results (vLLM v1's GPUModelRunner / TPUModelRunner split, in small).

The device state is every layer's KV cache, (slots, max_seq_len, n_kv_heads, head_dim), and one
row per slot of the decode inputs: ints (slots, 5) [last token, position, pad, seed, top_k] and
floats (slots, 2) [temperature, top_p]. Two programs change it, each one XLA graph per shape:

- `prefill_program`: one prompt section of R requests, written straight into their slots' cache
  rows (no separate prefill cache, no copy afterwards); the LM head runs at the last position only
  (every position only when the prompt's log-probabilities are asked for); the first token is
  sampled in the same program, and the slots' state rows set (parked until the last section);
- `decode_program`: one token for every slot, sampled in the same program, the state advanced.

Both take the caches as arguments and return the new ones: inside the program each layer's
`KVCache` is swapped for a `SlotCache`, which writes out of place. That is what makes a
torch.compile'd program update the caches in place: XLA writes an output into an input's buffer
when the input is donated (`torch.ops.xla.dynamo_set_buffer_donor_`, set before each call: the
mark does not carry over to the outputs), and `Caches` keeps the outputs as the caches. Written
in place inside the compiled function instead, torch_xla's openxla bridge returns the written
caches and copies each back into its input after every call, a full copy of every cache per step
(measured: `tests/test_engine.py::test_every_program_writes_the_kv_caches_in_place`). With lazy
tensors (compile=False) the runner `copy_`s the returned caches into the ones it passed, which only
rebinds the pending graph, so the next sync updates each buffer in place, as an in-place op would.

Sources: vLLM v1's model runners, https://github.com/vllm-project/vllm (vllm/v1/worker/); torch_xla's
buffer donation under torch.compile, https://github.com/pytorch/xla/blob/v2.9.0/docs/source/perf/dynamo.md
"""
import itertools

import torch
import torch.nn as nn
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from .mesh import make_mesh
from .sampling import logprobs_of, sample_rows
from .sharding import Constraint


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


def prefill_program(model, views, caches, pin, state, tokens, input_pos, row, kv_len, targets=None):
    """One prompt section of R requests: tokens (R, n) at cache positions input_pos (n,) of their
    slots, attention over the first kv_len positions. row: the requests' slots (R,), ints (R, 5)
    [0, width, pad, seed, top_k] and floats (R, 2) [temperature, top_p]. targets (R, n): the next
    prompt token at each position, for the prompt's log-probabilities (None: not asked). The slots'
    state rows become the requests' rows, with the first token as the last token (parked before
    the last section: `ModelRunner.prefill`). Returns (first tokens (R,), their `logprobs_of`, the
    prompt's `logprobs_of` each (R, n, ...) or None, state, caches)."""
    slots, ints, floats = row
    attach(views, caches, slots)
    logits = model(tokens, input_pos, ints[:, 2], kv_len, last_only=targets is None)  # (R, 1 or n, vocab_size)
    prompt = None if targets is None else tuple(map(pin, logprobs_of(logits, targets)))
    logits = logits[:, -1]  # (R, vocab_size)
    pos = input_pos[-1].expand(tokens.shape[0])  # (R,): the last position, the same in every row
    first = pin(sample_rows(logits, floats[:, 0], floats[:, 1], ints[:, 3], pos, ints[:, 4]))  # (R,)
    new = (torch.cat([first[:, None], ints[:, 1:]], dim=-1), floats)  # (R, 5), (R, 2)
    state = tuple(pin(s.index_copy(0, slots, r)) for s, r in zip(state, new))
    return first, tuple(map(pin, logprobs_of(logits, first))), prompt, state, [(v.k, v.v) for v in views]


def decode_program(model, views, caches, pin, state, greedy, kv_len, max_seq_len):
    """One token for every slot, each at its own position, attention over the first kv_len cache
    positions; a free slot computes too (its token is ignored). greedy (a Python bool: two graphs)
    is a bare argmax, for when no busy slot samples or asks for log-probabilities. Returns (tokens
    (slots,), their `logprobs_of` or None, state, caches)."""
    ints, floats = state
    tokens, pos, pad, seed, top_k = ints.unbind(dim=-1)  # each (slots,)
    attach(views, caches)
    logits = model(tokens[:, None], pos[:, None], pad, kv_len)[:, -1]  # (slots, vocab_size)
    if greedy:
        nxt, logprobs = logits.argmax(dim=-1), None
    else:
        nxt = sample_rows(logits, floats[:, 0], floats[:, 1], seed, pos, top_k)
        logprobs = tuple(map(pin, logprobs_of(logits, nxt)))
    pos = (pos + 1).clamp(max=max_seq_len - 1)  # a free slot stays in its row
    ints = torch.stack([nxt, pos, pad, seed, top_k], dim=-1)  # (slots, 5)
    # floats unchanged, but a copy: a compiled program's output that is one of its inputs comes back as a
    # view of it, and the next program traced on that view bakes its value in as a constant (measured)
    return pin(nxt), logprobs, (pin(ints), floats.clone()), [(v.k, v.v) for v in views]


class ModelRunner:
    """The device side of `engine.Engine` over a `Llama` (moved to the XLA device if on the CPU;
    or sharded by `parallel.shard_for_inference`): the model's own KV caches become the slots'
    (max_batch_size >= slots rows), and `prefill` / `decode` launch the programs above, compiled
    with torch.compile(backend="openxla") if `compile` (`shapes`: how many shapes they take, at most),
    else traced as lazy tensors at every call."""

    def __init__(self, model, slots, compile, shapes=0):
        self.device = torch_xla.device()
        self.model = model if model.embed_tokens.weight.device.type == "xla" else model.to(self.device)
        if getattr(self.model, "mesh", None) is None:
            mark_replicated(self.model)
        self.mesh = getattr(self.model, "mesh", None) or make_mesh()
        self.pin = replicator(self.model)
        self.caches = Caches(self.model, compile)
        self.slots, self.max_seq_len = slots, self.model.args.max_seq_len
        self.state = (self.put(torch.zeros(slots, 5, dtype=torch.long)), self.put(torch.ones(slots, 2)))
        if compile:
            self.prefill_program, self.decode_program = compiled(prefill_program, shapes), compiled(decode_program, shapes)
        else:
            self.prefill_program, self.decode_program = prefill_program, decode_program

    def put(self, t):
        """A host tensor on the device, annotated 'replicated' as data (not as a graph op, which
        would make its first use a different graph from its later ones)."""
        t = t.to(self.device)
        xs.mark_sharding(t, self.mesh, (None,) * t.dim())
        return t

    def run(self, program, *args):
        """Launch a program on the caches and the state; keep both; return its other outputs."""
        *out, self.state = self.caches.run(program, self.pin, self.state, *args)
        return out
    def prefill(self, slots, ints, floats, tokens, start, kv_len, targets=None, last=True):
        """Launch one prompt section (host lists: slots (R,), ints (R, 5), floats (R, 2), tokens
        (R, n) starting at cache position `start`, targets (R, n) or None); returns
        `prefill_program`'s device outputs (first tokens, their logprobs, the prompt's).

        Before their last section, the slots' state rows are parked at position max_seq_len - 1:
        the decode steps in between write there, a position no request reads (a request's last
        input sits at max_seq_len - 2 at most), not into the prompt just written."""
        if not last:
            ints = [[0, self.max_seq_len - 1, *r[2:]] for r in ints]
        row = self.put(torch.tensor(slots)), self.put(torch.tensor(ints)), self.put(torch.tensor(floats))
        input_pos = self.put(torch.arange(start, start + len(tokens[0])))
        targets = None if targets is None else self.put(torch.tensor(targets))
        return self.run(self.prefill_program, self.put(torch.tensor(tokens)), input_pos, row, kv_len, targets)

    def decode(self, greedy, kv_len):
        """Launch one decode step; returns its device outputs (tokens (slots,), logprobs or None)."""
        return self.run(self.decode_program, greedy, kv_len, self.max_seq_len)

    @staticmethod
    def read(outputs):
        """Device outputs as host tensors (this waits for the programs that make them)."""
        return None if outputs is None else tuple(t.cpu() for t in outputs)
