"""The engine's output side: a request's new tokens become its text and log-probabilities, and
EOS, a stop string or max_tokens ends it (vLLM v1's output processor, in small). Host-side only:
the tokens and log-probabilities arrive as host values (`runner.ModelRunner.read`)."""
import time


def entry(req, lp, i):
    """Row i of host `sampling.logprobs_of` outputs as req reports it: (log-probability,
    [(id, log-probability)] of its req.logprobs most likely tokens)."""
    chosen, values, ids = lp
    k = req.logprobs or 0
    return float(chosen[i]), list(zip(ids[i, :k].tolist(), values[i, :k].tolist()))


def add_token(req, token, lp, eos_ids):
    """Append a new token (and its `logprobs_of`, host tensors of one row) to req; returns the
    finish reason it causes ("stop" on EOS or a stop string, "length" at max_tokens) or None."""
    if req.first_token_at is None:
        req.first_token_at = time.perf_counter()
    req.tokens.append(token)
    if req.logprobs is not None:
        req.token_logprobs.append(entry(req, lp, 0))
    if req.stream is not None:
        req.stream.add(token)
        req.text = req.stream.text
        if req.stream.stopped:
            return "stop"
    if token in eos_ids and not req.ignore_eos:
        return "stop"
    if len(req.tokens) >= req.max_tokens:
        return "length"
    return None


def add_prompt_logprobs(req, lp, start, n):
    """The log-probabilities of req's prompt tokens that positions start ... start + n - 1 predict
    (host `logprobs_of`, each (n, ...)): position p predicts prompt token p + 1. Those it already
    has (a prompt computed again after a preemption) are kept."""
    have = len(req.prompt_token_logprobs)
    req.prompt_token_logprobs += [entry(req, lp, p - start) for p in range(max(start, have), start + n)
                                  if p < len(req.prompt) - 1]


def settle(req, reason, error=None):
    """Record how req ended, with the text held back for a possible stop string let out."""
    if req.stream is not None:
        req.stream.flush()
        req.text = req.stream.text
    req.finish_reason, req.error, req.finished_at = reason, error, time.perf_counter()
