"""From engine tokens to text deltas: an asyncio queue fed by the engine thread, stop strings,
incomplete multi-byte characters held back, the request aborted when its reader goes away."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.concurrency import run_in_threadpool

POLL_S = 0.25  # how often a waiting non-streaming request checks that its client is still there


@dataclasses.dataclass(frozen=True)
class Delta:
    text: str
    finish_reason: str | None  # None while tokens keep coming
    tokens: int | None = None  # the answer's tokens where it ends before the engine's output (a stop string)


def first_stop(text: str, stop: tuple[str, ...]) -> int:
    """Index of the earliest stop string in text, -1 if none."""
    return min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)


class StopPrefixes:
    """How much of a growing text's end begins some stop string: text a later token could complete
    into a stop, so it is held back until it cannot. Each stop string's matched prefix is carried
    from call to call (Knuth-Morris-Pratt), so each new character costs O(1) per stop string
    however long they are; a text whose earlier part changed (a tokenizer merge) is read again."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stops = [s for s in stop if s]
        self.fail = [_failure(s) for s in self.stops]
        self.matched = [0] * len(self.stops)
        self.read = ""

    def held(self, text: str) -> int:
        if not text.startswith(self.read):  # a match depends on the last len(stop) characters alone: read those
            longest = max(map(len, self.stops), default=0)
            self.matched, self.read = [0] * len(self.stops), text[: max(0, len(text) - longest)]
        for ch in text[len(self.read) :]:
            for i, s in enumerate(self.stops):
                k, fail = self.matched[i], self.fail[i]
                while k and (k == len(s) or s[k] != ch):
                    k = fail[k - 1]
                self.matched[i] = k + 1 if s[k] == ch else k
        self.read = text
        # a whole stop string matched (the caller's stop; its longest proper prefix ending the text is its border)
        return max((k if k < len(s) else f[-1] for k, s, f in zip(self.matched, self.stops, self.fail)), default=0)


def _failure(s: str) -> list[int]:
    """KMP's table: fail[i] = the longest proper prefix of s[: i + 1] that is also its suffix."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        k += s[i] == s[k]
        fail[i] = k
    return fail


class GrowingText:
    """The text of a growing list of token ids, as decode(ids) reads it, at the cost of decoding a few
    tokens per token added instead of all of them (a 2000-token answer decoded whole at every token took
    0.46 s of the event loop on the 2-core VM, SmolLM2's tokenizer). Each decode starts at the token
    settled before the last (its context decides a token's leading space); a token whose text is not
    complete yet (a multi-byte character split across tokens: U+FFFD at the end) or empty waits for the
    next. Where the window's earlier text changes (a tokenizer that cleans up spaces across tokens), or
    WINDOW tokens wait, the whole list is decoded again. deltas() decodes the whole list at the end."""

    WINDOW = 64  # tokens a window may grow to before the whole list is decoded again
    CONTEXT = 4  # tokens a window starts before the last settled one, after a whole decode

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode, self.ids, self.text = decode, [], ""
        self.start = 0  # first token of the window decoded for context
        self.settled = 0  # tokens whose text is in self.text

    def add(self, tok: int) -> str:
        self.ids.append(tok)
        before = self.decode(self.ids[self.start : self.settled])
        now = self.decode(self.ids[self.start :])
        if now.startswith(before) and len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before) :]
            self.start, self.settled = self.settled, len(self.ids)
        elif not now.startswith(before) or len(self.ids) - self.start > self.WINDOW:
            whole = self.decode(self.ids)
            if not whole.endswith("\ufffd"):  # else: again at the next token, which may complete the character
                self.text, self.settled = whole, len(self.ids)
                self.start = max(0, self.settled - self.CONTEXT)
        return self.text


async def submit(
    engine: Any, prompt_ids: list[int], params: Any, reuse: bool, arrival_time: float | None = None
) -> tuple[Any, asyncio.Queue]:
    """Check and queue a request that arrived at `arrival_time` (perf_counter; default now); its
    tokens arrive on the returned queue as ("tok", id), then ("end", None). Raises the engine's
    KVCodecError for a request it refuses."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()

    def on_token(req: Any, tok: int) -> None:
        loop.call_soon_threadsafe(q.put_nowait, ("tok", tok))

    def on_finish(req: Any) -> None:
        loop.call_soon_threadsafe(q.put_nowait, ("end", None))

    req = await run_in_threadpool(
        engine.submit,
        prompt_ids,
        params,
        reuse=reuse,
        on_token=on_token,
        on_finish=on_finish,
        arrival_time=arrival_time,
    )
    return req, q


class _Watch:
    """Asks `gone` at most every POLL_S, whether tokens keep arriving or not (a request whose
    tokens come faster than POLL_S must notice its client leaving too)."""

    def __init__(self, gone: Callable[[], Awaitable[bool]] | None) -> None:
        self.gone = gone
        self.checked = asyncio.get_running_loop().time()

    async def client_left(self) -> bool:
        now = asyncio.get_running_loop().time()
        if self.gone is None or now - self.checked < POLL_S:
            return False
        self.checked = now
        return await self.gone()


async def _next(q: asyncio.Queue, watch: _Watch) -> tuple[str, int | None]:
    while True:
        if await watch.client_left():
            return ("gone", None)
        try:
            return await asyncio.wait_for(q.get(), POLL_S)
        except TimeoutError:
            continue


async def deltas(
    engine: Any, req: Any, q: asyncio.Queue, stop: tuple[str, ...], gone: Callable[[], Awaitable[bool]] | None = None
) -> AsyncIterator[Delta]:
    """Text deltas of `req` as its tokens arrive; the last one carries the finish reason. `gone`:
    an async check that the client disconnected (the request is then aborted)."""
    sent, grown = "", GrowingText(engine.decode_text)
    ids = grown.ids
    watch, held = _Watch(gone), StopPrefixes(stop)
    try:
        while True:
            kind, tok = await _next(q, watch)
            if kind == "gone":
                return
            if kind == "end":
                text = engine.decode_text(ids)
                hit = first_stop(text, stop)  # the last token's text, where it ended a character late
                if hit >= 0:
                    text = text[:hit]
                finish = "stop" if hit >= 0 else req.finish_reason or "stop"
                yield Delta(text[len(sent) :] if text.startswith(sent) else "", finish, tokens=len(ids))
                return
            text = grown.add(tok)  # an incomplete multi-byte character waits for the next token
            hit = first_stop(text, stop)
            if hit >= 0:
                engine.abort(req, "stop")
                yield Delta(text[len(sent) : hit] if hit >= len(sent) else "", "stop", tokens=len(ids))
                return
            ready = text[: len(text) - held.held(text)]
            if not ready.startswith(sent):  # a later token changed earlier text (a merge): go on from here
                sent = ready
            elif len(ready) > len(sent):
                delta, sent = ready[len(sent) :], ready
                yield Delta(delta, None)
    finally:
        if not req.finished:
            engine.abort(req)
