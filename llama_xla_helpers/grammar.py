"""Structured output: the grammars a request's tokens must follow, compiled by xgrammar.

    grammars = Grammars(tokenizer, vocab_size=model.args.vocab_size, stop_ids=engine.eos_ids)
    compiled = grammars.response_format({"type": "json_schema", "json_schema": {"schema": schema}})
    req = engine.submit(prompt, max_tokens, grammar=compiled)   # its text parses and validates

A JSON schema (or "any JSON object") becomes a grammar over the tokenizer's vocabulary, compiled
once (`xgrammar.GrammarCompiler`, which caches it). Each request gets a matcher of its own
(`matcher`), the grammar's state after its tokens so far. Before a step, the host fills the slot's
row of the step's token bitmask from it (`runner.ModelRunner.bitmask`: bit j of word i allows token
32 i + j; `sampling.allowed_by` reads it on the device), and the step samples only allowed tokens;
after it, the matcher accepts the token sampled (`engine.Engine.emit`). Once the grammar is
complete it allows only the stop ids, so the request ends with "stop" (or "length" first, at
max_tokens: then its text may not parse, as OpenAI's). The matcher needs every token before it
fills the next mask, so while a request with a grammar runs, the engine reads each step's tokens
before the next step, giving up its one-step lag (engine.py).

A known limit of xgrammar 0.2.8: a string with maxLength or minLength compiles to a rule that also
allows raw control characters (U+0000-U+001F), which strict JSON parsers reject; a plain string,
or one with a `pattern`, does not (tests/test_grammar.py checks both). And a pattern's repetition
count above 128 (`[a-z]{129}`) does not compile (a ValueError); `[a-z]{100}[a-z]{29}` does.

xgrammar is imported here only, when a request asks for a grammar. It is vLLM's and SGLang's
grammar engine: Dong et al., "XGrammar: Flexible and Efficient Structured Generation Engine for
Large Language Models" (MLSys 2025), https://arxiv.org/abs/2411.15100,
https://github.com/mlc-ai/xgrammar
"""
import functools
import json

from .tokenizer import ByteTokenizer


class Grammars:
    """The compiled grammars of one tokenizer: `response_format(fmt)` for OpenAI's response_format,
    `json_schema(schema)`. vocab_size: the model's (its logits' width, which may pass the
    tokenizer's); stop_ids: the ids that end a request (the engine's `eos_ids`)."""

    def __init__(self, tokenizer, vocab_size, stop_ids):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_ids)

    @functools.cached_property
    def compiler(self):
        import xgrammar
        if isinstance(self.tokenizer, ByteTokenizer):  # ids 0-255 are the bytes; BOS and EOS have no text
            vocab = [bytes([i]) for i in range(256)] + [b""] * (ByteTokenizer.vocab_size - 256)
            info = xgrammar.TokenizerInfo(vocab, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids)
        else:
            info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=self.stop_ids)
        return xgrammar.GrammarCompiler(info)

    def json_schema(self, schema, where="schema"):
        """The grammar of JSON text that validates against `schema` (a dict or a JSON string);
        ValueError naming `where` and xgrammar's reason if it cannot compile it."""
        try:
            return self.compiler.compile_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                                     any_whitespace=False)
        except RuntimeError as e:  # xgrammar's: "[time] file.cc:line: reason"
            reason = str(e).strip().split(": ", 1)[-1]
            raise ValueError(f"{where}: xgrammar cannot compile this JSON schema: {reason}") from None

    def response_format(self, fmt):
        """The grammar of OpenAI's response_format (a dict): None for {"type": "text"}, any JSON
        object for "json_object", the schema's for {"type": "json_schema", "json_schema": {"name",
        "schema", "strict"}}. ValueError naming the part that is wrong."""
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return self.json_schema({"type": "object"}, "response_format")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
                raise ValueError("response_format.json_schema must be an object with a 'schema' object, e.g. "
                                 "{'name': 'answer', 'schema': {'type': 'object', ...}}")
            return self.json_schema(spec.get("schema", {}), "response_format.json_schema.schema")
        raise ValueError(f"response_format.type={kind!r} must be 'text', 'json_object' or 'json_schema'")


def matcher(compiled):
    """A request's own state in a compiled grammar: fill_next_token_bitmask(bitmask, row),
    accept_token(id), is_terminated()."""
    import xgrammar
    return xgrammar.GrammarMatcher(compiled)
