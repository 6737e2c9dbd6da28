"""Request bodies of the OpenAI-compatible endpoints, checked field by field at the door.

`parse_completion(body)` / `parse_chat(body)` turn a decoded JSON body into a frozen
GenerationRequest or raise BadRequestError naming the field; nothing unchecked reaches the engine.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from kvcodec.engine.sequence import SamplingParams

DEFAULT_MAX_TOKENS = 16  # a completion's without max_tokens (OpenAI's completions); a chat's: the context's room
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
ROLES = ("system", "user", "assistant", "tool", "developer")


class BadRequestError(ValueError):
    """A request the server refuses with HTTP `status` (400; 413 for an oversize body); `param`
    names the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def text_field(s: str, name: str) -> str:
    """`s` when it is valid Unicode text (no lone surrogate such as a JSON "\\ud800")."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequestError(f"{name} is not valid Unicode text ({e.reason} at character {e.start})", name) from None
    return s


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One checked request: a prompt (text, token ids or chat messages) and how to answer it."""

    chat: bool
    prompt: str | tuple[int, ...] | None
    messages: tuple[tuple[str, str], ...]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    reuse: bool
    model: str | None
    max_tokens_given: bool = True  # the client set max_tokens (or max_completion_tokens)

    def fitted(self, prompt_tokens: int, context: int | None) -> GenerationRequest:
        """This request with its output length set where the client left it out: default_max_tokens."""
        if self.max_tokens_given:
            return self
        n = default_max_tokens(self.chat, prompt_tokens, context)
        return dataclasses.replace(self, params=dataclasses.replace(self.params, max_new_tokens=n))


def default_max_tokens(chat: bool, prompt_tokens: int, context: int | None) -> int:
    """The output length of a request without max_tokens: a chat answers up to the room its prompt leaves
    in the model's context (as OpenAI's and vLLM's chat endpoints), a completion DEFAULT_MAX_TOKENS (OpenAI's
    completions default) or that room if less; at least 1 (a prompt that fills the context is refused for
    its length). Pure."""
    if context is None:
        return DEFAULT_MAX_TOKENS
    room = max(1, context - prompt_tokens)
    return room if chat else min(DEFAULT_MAX_TOKENS, room)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def shown(v: Any, limit: int = 60) -> str:
    """A client's value as an error message quotes it: its repr, cut to `limit` characters."""
    try:
        r = repr(v)
    except ValueError:  # an integer of more digits than Python converts
        return f"an integer of {v.bit_length()} bits"
    return r if len(r) <= limit else f"{r[: limit - 3]}..."


def _number(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    try:
        ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    except OverflowError:  # an integer beyond any float
        ok = False
    if not ok:
        raise BadRequestError(f"{name} must be a finite number; got {shown(v)}", name)
    return float(v)


def _max_tokens(body: dict) -> int:
    name = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    v = body.get(name)
    if v is None:
        return DEFAULT_MAX_TOKENS
    if not _is_int(v):
        raise BadRequestError(f"{name} must be an integer; got {shown(v)}", name)
    if v < 1:
        raise BadRequestError(f"{name} must be >= 1; got {v}", name)
    return v


def sampling_params(body: dict) -> SamplingParams:
    temperature = _number(body, "temperature", 0.0)
    if temperature < 0:
        raise BadRequestError(f"temperature must be >= 0; got {temperature:g}", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise BadRequestError(f"top_p must be in (0, 1]; got {top_p:g}", "top_p")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
        raise BadRequestError(f"seed must be an integer in [0, 2**63); got {shown(seed)}", "seed")
    return SamplingParams(
        max_new_tokens=_max_tokens(body),
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        ignore_eos=_flag(body, "ignore_eos", False),
    )


def stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequestError("stop must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise BadRequestError(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS}", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise BadRequestError(f"stop strings hold at most {MAX_STOP_CHARS} characters", "stop")
    return tuple(text_field(s, "stop") for s in stop if s)


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequestError(f"{name} must be true or false; got {shown(v)}", name)
    return v


NOT_SUPPORTED = {  # OpenAI fields this server does not implement, and the values of theirs that ask for nothing
    "logprobs": (False,),
    "top_logprobs": (0,),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "logit_bias": ({},),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "tools": ([],),
    "functions": ([],),
    "response_format": ({"type": "text"},),
}


def _refuse_unsupported(body: dict) -> None:
    """A field the server would ignore while the client counts on it (logprobs: 5 answered null) is a 400."""
    for name, neutral in NOT_SUPPORTED.items():
        v = body.get(name)
        if v is not None and not any(v == n and isinstance(v, bool) == isinstance(n, bool) for n in neutral):
            raise BadRequestError(f"{name} is not supported by this server; got {shown(v)}", name)


def _common(body: dict) -> dict[str, Any]:
    _refuse_unsupported(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequestError("model must be a string", "model")
    if model is not None and len(text_field(model, "model")) > 1024:
        raise BadRequestError("model names hold at most 1024 characters", "model")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise BadRequestError("only n = 1 is supported", "n")
    return {
        "params": sampling_params(body),
        "stop": stop_strings(body),
        "stream": _flag(body, "stream", False),
        "reuse": _flag(body, "kvcodec_reuse", True),
        "model": model,
        "max_tokens_given": body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None,
    }


def parse_completion(body: Any) -> GenerationRequest:
    """A /v1/completions body: prompt is a non-empty string (or a list of one) or token ids."""
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequestError("empty prompt", "prompt")
        text_field(prompt, "prompt")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompt = tuple(prompt)
    else:
        raise BadRequestError("prompt must be a non-empty string or a non-empty list of integer token ids", "prompt")
    return GenerationRequest(chat=False, prompt=prompt, messages=(), **_common(body))


def parse_chat(body: Any) -> GenerationRequest:
    """A /v1/chat/completions body: messages is a non-empty list of {role, content} objects."""
    body = _object(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequestError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRequestError(f"messages[{i}] must be an object with role and content", "messages")
        role, content = m.get("role", "user"), m.get("content")
        if not isinstance(role, str) or role not in ROLES:
            raise BadRequestError(f"messages[{i}].role must be one of {list(ROLES)}; got {shown(role)}", "messages")
        if not isinstance(content, str):
            raise BadRequestError(f"messages[{i}].content must be a string", "messages")
        out.append((role, text_field(content, f"messages[{i}].content")))
    return GenerationRequest(chat=True, prompt=None, messages=tuple(out), **_common(body))


def prompt_chars(g: GenerationRequest) -> int:
    """Characters of text the request asks to tokenize (0 for token ids)."""
    if g.chat:
        return sum(len(c) for _, c in g.messages)
    return len(g.prompt) if isinstance(g.prompt, str) else 0


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise BadRequestError("the body must be a JSON object")
    return body
