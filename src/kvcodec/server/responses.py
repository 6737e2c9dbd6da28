"""Response bodies in the OpenAI shapes, plus the `kvcodec` object that says what reuse did."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any


@dataclasses.dataclass(frozen=True)
class Envelope:
    """What every response (or stream chunk) of one request shares."""

    id: str
    chat: bool
    created: int
    model: str
    prompt_tokens: int

    @classmethod
    def new(cls, chat: bool, model: str, prompt_tokens: int) -> Envelope:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        return cls(rid, chat, int(time.time()), model, prompt_tokens)

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def kvcodec_info(req: Any) -> dict[str, Any]:
    return {
        "ttft_s": req.ttft,
        "tpot_s": req.tpot,
        "matched_tokens": req.matched_tokens,
        "restored_tokens": req.restored_tokens,
        "prefilled_tokens": req.prefilled_tokens,
        "fetch_error": req.fetch_error,
        "fetch_deadline_s": req.fetch_deadline_s,
        "fetch_s": req.fetch_s,
        "restored_to_prefill_s": req.restored_to_prefill_s,
        "prefill_to_first_token_s": req.prefill_to_first_token_s,
        "bytes_fetched": int(req.fetch_stats.get("bytes_fetched", 0) or 0),
        "error": req.error,
    }


def usage(env: Envelope, req: Any, tokens: int | None = None) -> dict[str, int]:
    """Token counts; `tokens`: the answer's, where it ended before the engine's output did (a stop string)."""
    n = len(req.output_ids) if tokens is None else tokens
    return {"prompt_tokens": env.prompt_tokens, "completion_tokens": n, "total_tokens": env.prompt_tokens + n}


def completion(env: Envelope, req: Any, text: str, finish: str, tokens: int | None = None) -> dict[str, Any]:
    if env.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    obj = "chat.completion" if env.chat else "text_completion"
    return {**env.head(obj), "choices": [choice], "usage": usage(env, req, tokens), "kvcodec": kvcodec_info(req)}


def chunk(env: Envelope, req: Any, delta: str, finish: str | None, tokens: int | None = None) -> dict[str, Any]:
    if env.chat:
        choice = {"index": 0, "delta": {"content": delta} if delta else {}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
    out = {**env.head("chat.completion.chunk" if env.chat else "text_completion"), "choices": [choice]}
    if finish is not None:
        out["usage"] = usage(env, req, tokens)
        out["kvcodec"] = kvcodec_info(req)
    return out


def role_chunk(env: Envelope) -> dict[str, Any]:
    """The first chunk of a chat stream."""
    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    return {**env.head("chat.completion.chunk"), "choices": [first]}


def error(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"
