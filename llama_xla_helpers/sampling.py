"""Sampling on the device: a next token per row, each row with its own temperature, top-k, top-p
and seed, and the log-probabilities a request asks for. `Generator` and the engine's runner both
call these inside their compiled programs; the runner first applies what else a request asks of
its logits (`adjusted`: OpenAI's logit_bias, presence and frequency penalties, a grammar's token
bitmask).

The noise is a hash of (seed, position), not a random generator's state, so a request samples
the same tokens whatever shares its batch. Sampling first keeps the SAMPLE_TOP_K most likely
tokens (vLLM's and JetStream's TPU samplers bound the vocabulary the same way), so no step sorts
the vocabulary.
"""
import torch

TOP_LOGPROBS = 20  # alternatives a token's log-probabilities can list (OpenAI's limit)

SAMPLE_TOP_K = 64  # sampling draws from at most this many of the most likely tokens


def uniform(seed, pos, n):
    """(B, n) numbers in (0, 1), a hash of (seed, pos, index): the same draw for a request's
    position wherever it sits in the batch. seed, pos: (B,) int64."""
    x = (seed[:, None] * 0x9E3779B1 + pos[:, None] * 0x85EBCA77 + torch.arange(n, device=seed.device)) & 0xFFFFFFFF
    for _ in range(2):  # mix the bits (a 32-bit integer hash; the masks keep it in 32 bits)
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (x >> 16) ^ x
    return ((x >> 8).float() + 0.5) / 2 ** 24  # 24 bits: exact in fp32, never 0 or 1


def sample_rows(logits, temperature, top_p, seed, pos, top_k=None):
    """Next token per row (B,) from logits (B, vocab_size), each row with its own temperature,
    top_p (B,) fp32, seed (B,) int64 and top_k (B,) int64 (0 or None: SAMPLE_TOP_K): greedy where
    temperature is 0, else top-k, then top-p, sampling. The noise is a hash of (seed, pos) (pos
    (B,) int64: the position sampled from)."""
    greedy = logits.argmax(dim=-1)
    k = min(SAMPLE_TOP_K, logits.shape[-1])
    top, order = logits.topk(k, dim=-1)  # (B, k), most likely first: no sort of the vocabulary
    if top_k is not None:
        rank = torch.arange(k, device=logits.device)
        top = top.masked_fill((top_k[:, None] > 0) & (rank >= top_k[:, None]), float("-inf"))
    probs = torch.softmax(top / temperature.clamp(min=1e-6)[:, None], dim=-1)
    drop = probs.cumsum(dim=-1) - probs > top_p[:, None]  # top-p: keep the tokens whose mass before them <= top_p
    probs = probs.masked_fill(drop, 0.0)
    # The exponential race: argmax(p / E) with E ~ Exp(1) (E = -log U) draws index i with probability p_i.
    pick = (probs / -uniform(seed, pos, k).log()).argmax(dim=-1)  # (B,)
    sampled = order.gather(-1, pick[:, None])[:, 0]
    return torch.where(temperature > 0, sampled, greedy)


def allowed_by(bitmask, vocab_size):
    """(B, vocab_size) bool from a token bitmask (B, ceil(vocab_size / 32)) int32 in xgrammar's
    layout: bit j of word i (1 << j) allows token 32 i + j (-1, every bit set: every token).
    bitwise_right_shift, not `>>`: on the XLA device torch_xla 2.9's `>>` gives -1 >> 1 == 0 (measured)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return torch.bitwise_right_shift(bitmask[:, :, None], bits).bitwise_and(1).flatten(1)[:, :vocab_size].bool()


def adjusted(logits, bias, counts, presence, frequency, bitmask):
    """logits (B, vocab_size) as the rest of a request's sampling settings change them: plus its
    logit_bias (bias (B, vocab_size)), minus frequency x count and minus presence where the count
    is above 0 (OpenAI's penalties; presence, frequency (B,), counts (B, vocab_size): the times each
    token was generated so far), and -inf for the tokens its grammar does not allow (bitmask,
    `allowed_by`). Computed in fp32 and returned in the logits' dtype (with no bias, penalty or
    grammar: the logits unchanged)."""
    counts = counts.float()
    out = logits.float() + bias - frequency[:, None] * counts - presence[:, None] * (counts > 0).float()
    return out.masked_fill(~allowed_by(bitmask, logits.shape[-1]), float("-inf")).to(logits.dtype)


def logprobs_of(logits, tokens):
    """Log-probabilities of tokens (...) under logits (..., vocab_size), and the TOP_LOGPROBS
    most likely tokens' (values, ids), each (..., TOP_LOGPROBS)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = lp.topk(min(TOP_LOGPROBS, lp.shape[-1]), dim=-1)
    return lp.gather(-1, tokens[..., None])[..., 0], top.values, top.indices
