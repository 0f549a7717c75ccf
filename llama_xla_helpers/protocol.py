"""The OpenAI protocol of the server (`api.py`): what a request may hold and how it is checked,
its prompts as token ids, and the parts of a response that are formatting only (log-probabilities,
the error object). No app and no engine loop here.

Parameters, with OpenAI's names and defaults:

- /v1/completions (`CompletionBody`): prompt (a string, a list of strings, a list of token ids, or a
  list of lists of ids), max_tokens (default 16), echo (the prompt before the completion; with
  logprobs, its tokens' log-probabilities too, and max_tokens 0 scores the prompt without
  generating), logprobs (0-20: each token's log-probability and that many alternatives).
- /v1/chat/completions (`ChatBody`): messages, max_tokens / max_completion_tokens (default: the room
  left in the context), logprobs (true) with top_logprobs (0-20).
- Both (`Sampling`): model, temperature (default 1; 0 is greedy), top_p, top_k (vLLM's extension: at
  most sampling.SAMPLE_TOP_K; 0 or -1 sets no limit of its own, so sampling keeps the engine's bound,
  the SAMPLE_TOP_K = 64 most likely tokens, as vLLM's and JetStream's TPU samplers do), seed
  (choice j of n uses seed + j), n (choices per prompt, up to MAX_N), stop (up to 4 non-empty
  strings), stream, stream_options.include_usage (a usage chunk at the end) and
  .continuous_usage_stats (vLLM's: usage so far in every chunk), user, and vLLM's ignore_eos (an
  EOS id does not end the request) and min_tokens (no EOS id is sampled before that many tokens:
  the engine masks them on the device), OpenAI's logit_bias (up to 300 token ids, each -100 to 100,
  added to its logit), presence_penalty and frequency_penalty (-2 to 2, over the tokens generated
  so far) and response_format ({"type": "json_object"}: any JSON object; {"type": "json_schema",
  "json_schema": {"schema": ...}}: JSON valid against the schema, through xgrammar,
  `grammar.py`; a schema it cannot compile is a 400 naming the part), all applied on the device
  inside the step. Chat messages' content is a string or OpenAI's list of text parts (joined a
  line apart, as vLLM does; an image part is a 400). Any other field is refused with a 400 that
  names it; suffix and best_of other than n are refused unless they ask for nothing
  (`check_supported`).
- Chat's tools and tool_choice ("none", "auto", the default with tools, "required", or
  {"type": "function", "function": {"name": ...}}): the template renders the tools (a template that
  never reads `tools` is a 400), and an answer in Llama 3.1's JSON tool-call format, {"name": ...,
  "parameters": {...}}, comes back as OpenAI's `tool_calls` (arguments as a JSON string) with
  finish_reason "tool_calls" (`tool_calls`). With "required" or a named function the answer is
  constrained to such a call by its grammar (`ChatBody.tool_schema`); with "auto" the model may
  answer in text. An assistant message's tool_calls and a "tool" message's result go back
  through the template in the next request.

Log-probabilities are the model's, before temperature and top-k/top-p; a token whose bytes are not
UTF-8 on their own (a byte token) is written `bytes:\\xc3` as OpenAI does, never U+FFFD.

Errors are OpenAI's JSON, {"error": {"message", "type", "param", "code"}} (`api_error`), whatever
goes wrong; `api.py` lists the statuses.

Prompts: /v1/completions encodes the prompt as it is (with BOS). /v1/chat/completions uses the
tokenizer's chat template if it has one. Otherwise (the byte tokenizer of a training checkpoint,
or a tokenizer without a template) it writes a plain transcript: one "role: content" line per
message, then "assistant:".

The split is vLLM's and SGLang's: the request models in a protocol.py of their own
(vllm/entrypoints/openai/protocol.py, python/sglang/srt/entrypoints/openai/protocol.py), the app
apart. Sources: the OpenAI API reference, completions
https://platform.openai.com/docs/api-reference/completions and chat
https://platform.openai.com/docs/api-reference/chat; vLLM's OpenAI server (top_k),
https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html; Llama 3.1's JSON tool calls,
https://www.llama.com/docs/model-cards-and-prompt-formats/llama3_1/#json-based-tool-calling
"""
import itertools
import json
import secrets
from typing import Literal

import jinja2
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from .detokenize import token_bytes, token_key
from .sampling import SAMPLE_TOP_K, TOP_LOGPROBS
from .tokenizer import ByteTokenizer

MAX_N = 16  # choices per prompt


def api_error(status, message, type="invalid_request_error", param=None, code=None):
    """An HTTPException whose detail is OpenAI's error object (`api.http_error` answers with it)."""
    return HTTPException(status, dict(message=message, type=type, param=param, code=code))


# --- Requests ----------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk, so far


class Sampling(BaseModel):
    """What both endpoints take, with OpenAI's names and defaults. A field that is not here is
    refused (400 naming it); those in UNSUPPORTED are refused unless they ask for nothing."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, ge=-1, le=SAMPLE_TOP_K, description=(  # vLLM's extension
        f"sample from the top_k most likely tokens; 0 or -1: no limit of the request's own, so the engine's: "
        f"the {SAMPLE_TOP_K} most likely (engine.SAMPLE_TOP_K)"))
    seed: int | None = None
    stop: str | list[str] | None = None  # up to 4 (`check_supported`), non-empty (the engine checks)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # {token id as a string: -100 to 100}, at most LOGIT_BIAS_MAX
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    ignore_eos: bool = False  # vLLM's: generate on past an EOS id, to max_tokens (stop strings still stop)
    min_tokens: int = Field(0, ge=0)  # vLLM's: no EOS id is sampled before this many tokens


class CompletionBody(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str | list[dict] | None = None  # a string, or OpenAI's content parts: [{"type": "text", "text": ...}, ...]
    tool_calls: list[dict] | None = None  # an assistant's: [{"id", "type": "function", "function": {"name",
    # "arguments"}}]
    tool_call_id: str | None = None  # a tool's result: the call it answers
    name: str | None = None

    def text(self):
        """The content as text: the text parts joined in order, a line apart (as vLLM joins them);
        400 for any other part (an image: this model reads text only)."""
        if self.content is None:
            if self.role == "assistant" and self.tool_calls:
                return ""
            raise api_error(400, f"a {self.role!r} message without content: only an assistant's tool_calls may "
                                 f"leave it out", param="messages")
        if isinstance(self.content, str):
            return self.content
        texts = []
        for i, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise api_error(400, f"content part {i} has type {part.get('type')!r}: this server takes text parts "
                                     f"only, {{'type': 'text', 'text': ...}} (the model reads no images or audio)",
                                param="messages")
            texts.append(part["text"])
        return "\n".join(texts)

    def for_template(self):
        """The message as a chat template reads it: its text, and an assistant's tool calls with their
        arguments as objects (OpenAI sends a JSON string; templates write them with tojson, as vLLM
        passes them)."""
        out = dict(role=self.role, content=self.text())
        if self.tool_calls:
            try:
                out["tool_calls"] = [dict(c, function=c["function"] | dict(arguments=json.loads(c["function"]["arguments"])))
                                     for c in self.tool_calls]
            except (KeyError, TypeError, ValueError):
                raise api_error(400, "each of tool_calls must be {'id', 'type': 'function', 'function': {'name', "
                                     "'arguments': a JSON string}}", param="messages") from None
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class Function(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict = {"type": "object", "properties": {}}  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: Function


class NamedFunction(BaseModel):
    name: str


class NamedChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None  # chat's newer name for max_tokens; wins if given
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None

    def tool_schema(self):
        """The JSON schema of the tool call this request must make (Llama 3.1's format: {"name":
        the function's, "parameters": its arguments}), or None when the model may answer in text
        (no tools, "none", "auto"); 400 for a choice no tool matches."""
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise api_error(400, f"tool_choice={choice!r} needs tools; send tools or leave tool_choice out",
                            param="tool_choice")
        if choice in (None, "none", "auto"):
            return None
        names = {t.function.name: t for t in self.tools or []}
        if choice != "required" and choice.function.name not in names:
            raise api_error(400, f"tool_choice names the function {choice.function.name!r}, which is not one of "
                                 f"tools: {sorted(names)}", param="tool_choice")
        calls = [{"type": "object", "required": ["name", "parameters"], "additionalProperties": False,
                  "properties": {"name": {"const": t.function.name}, "parameters": t.function.parameters}}
                 for t in (names.values() if choice == "required" else [names[choice.function.name]])]
        return calls[0] if len(calls) == 1 else {"anyOf": calls}

    def tools_on(self):
        """Whether an answer may be a tool call (tools, and a tool_choice other than "none")."""
        return bool(self.tools) and self.tool_choice != "none"


UNSUPPORTED = dict(suffix=(None, ""))


def tool_calls(text, tools):
    """OpenAI's tool_calls of an answer in Llama 3.1's JSON tool-call format ({"name": a function of
    `tools`, "parameters": {...}}, "arguments" accepted too, after an optional <|python_tag|>), or
    None if the answer is not one (text)."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    try:
        call = json.loads(body)
    except ValueError:
        return None
    names = {t.function.name for t in tools}
    arguments = isinstance(call, dict) and call.get("parameters", call.get("arguments"))
    if not isinstance(arguments, dict) or call.get("name") not in names:
        return None
    return [dict(id=f"chatcmpl-tool-{secrets.token_hex(8)}", type="function",
                 function=dict(name=call["name"], arguments=json.dumps(arguments)))]


def check_supported(body):
    """400 naming a parameter this server does not implement, unless it has its no-op value, and
    for what the types leave open: max_tokens 0 without echo, over 4 stop strings, stream_options
    without stream."""
    for name, noop in UNSUPPORTED.items():
        value = getattr(body, name, noop if not isinstance(noop, tuple) else noop[0])
        if value not in (noop if isinstance(noop, tuple) else (noop,)):
            raise api_error(400, f"{name}={value!r} is not supported by this server; leave it out", param=name)
    if getattr(body, "best_of", None) not in (None, body.n):
        raise api_error(400, f"best_of={body.best_of} is not supported (only best_of == n); leave it out", param="best_of")
    if body.max_tokens == 0 and not getattr(body, "echo", False):
        raise api_error(400, "max_tokens=0 must be an int >= 1 (0 only with echo, to score the prompt)",
                        param="max_tokens")
    if isinstance(body.stop, list) and len(body.stop) > 4:
        raise api_error(400, f"stop={body.stop!r} holds more than 4 stop strings (OpenAI's limit)", param="stop")
    if body.stream_options and not body.stream:
        raise api_error(400, "stream_options is only allowed with stream: true", param="stream_options")
    if body.max_tokens is not None and body.min_tokens > body.max_tokens:
        raise api_error(400, f"min_tokens={body.min_tokens} is more than max_tokens={body.max_tokens}; ask for at "
                             f"most max_tokens", param="min_tokens")


def logit_bias_ids(body):
    """logit_bias with int keys (JSON's keys are strings); 400 for a key that is not a token id.
    The engine checks the ids' range, the values and the count (`engine.check_logit_bias`)."""
    try:
        return {int(k): v for k, v in (body.logit_bias or {}).items()}
    except ValueError:
        bad = next(k for k in body.logit_bias if not k.strip().lstrip("-").isdigit())
        raise api_error(400, f"logit_bias key {bad!r} is not a token id; its keys are token ids, e.g. "
                             f"{{\"1234\": -100}}", param="logit_bias") from None


def requested_logprobs(body):
    """The alternatives per token that a request's log-probabilities list (None: no log-probabilities);
    400 for chat's top_logprobs without logprobs."""
    if not isinstance(body, ChatBody):
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise api_error(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


# --- Prompts to token ids ----------------------------------------------------------------------

def encode(tokenizer, text):
    """Token ids of a prompt, with BOS (once: a chat template may have written it already)."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text)
    bos = tokenizer.bos_token
    return tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos)))


def chat_prompt(tokenizer, messages, tools=None):
    """The prompt of a chat: the tokenizer's template, else one "role: content" line per message.
    A template that fails is the request's fault: a 400 naming the template's message. tools
    (OpenAI's, as dicts): rendered by the template, which must read them (Llama 3.1's does); a
    400 if it does not."""
    template = getattr(tokenizer, "chat_template", None)
    if tools and "tools" not in (template or ""):
        raise api_error(400, "this model's chat template does not render tools (it never reads `tools`); serve a "
                             "model whose tokenizer's template does, such as Llama 3.1's, or leave tools out",
                        param="tools")
    if not template:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except jinja2.TemplateError as e:
        raise api_error(400, f"the model's chat template rejected these messages: {e}", param="messages") from None


def completion_prompts(tokenizer, prompt, vocab_size):
    """The token ids of each prompt: a string, a list of strings, a list of ids or a list of lists of ids."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise api_error(400, "prompt is empty; send a string, a list of strings or token ids", param="prompt")
    ids = [encode(tokenizer, p) if isinstance(p, str) else p for p in prompt]
    for p in ids:
        bad = [t for t in p if not 0 <= t < vocab_size]
        if not p or bad:
            raise api_error(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})" if bad else
                            "a prompt is empty; every prompt needs at least one token", param="prompt")
    return ids


# --- Log-probabilities in a response -----------------------------------------------------------

def completion_logprobs(tokenizer, entries, tokens, offset=0):
    """OpenAI's completions `logprobs` of tokens with their engine entries (None for a prompt's
    first). A token that is not UTF-8 alone is written `bytes:\\xNN` (`detokenize.token_key`)."""
    lengths = [len(tokenizer.decode([t])) for t in tokens[:-1]]
    return dict(tokens=[token_key(tokenizer, t) for t in tokens], token_logprobs=[e and e[0] for e in entries],
                top_logprobs=[e and {token_key(tokenizer, i): v for i, v in e[1]} for e in entries],
                text_offset=list(itertools.accumulate(lengths, initial=offset)))


def chat_logprobs(tokenizer, entries, tokens):
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}, `bytes` the
    token's own (`detokenize.token_bytes`)."""
    def item(token, value):
        return dict(token=token_key(tokenizer, token), logprob=value, bytes=list(token_bytes(tokenizer, token)))
    return dict(content=[item(t, v) | dict(top_logprobs=[item(i, w) for i, w in top])
                         for t, (v, top) in zip(tokens, entries)])
