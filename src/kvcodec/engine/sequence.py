"""A request's life in the engine: its sampling parameters, state, output tokens and timestamps."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

_ids = itertools.count()


@dataclasses.dataclass
class SamplingParams:
    """How to generate: greedy when temperature == 0, else softmax sampling (optionally top-p).

    stop_token_ids: extra token ids that end a request (the tokenizer's EOS always does unless
        ignore_eos is set).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


class State(enum.Enum):
    WAITING = "waiting"  # queued FCFS, no KV to fetch (or fetch not started yet: blocking policy)
    FETCHING = "fetching"  # its prefix KV is being fetched in the background
    READY = "ready"  # prefix restored (or fetch failed); waiting to join the running batch
    RUNNING = "running"  # in the running batch (prefilled, decoding)
    FINISHED = "finished"


@dataclasses.dataclass
class Request:
    """One generation request. Times are `time.perf_counter()` seconds."""

    prompt_ids: list[int]
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    request_id: str = dataclasses.field(default_factory=lambda: f"req-{next(_ids)}")
    reuse: bool = True  # may this request fetch a stored prefix?
    store: bool = True  # may this request's prompt KV be stored after its prefill?

    state: State = State.WAITING
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    aborted: bool = False
    abort_reason: str = "abort"  # the finish reason an aborted request ends with ("stop": a stop string)
    # prefix reuse
    matched_tokens: int = 0  # stored prefix found by the lookup
    restored_tokens: int = 0  # tokens whose KV was restored from the store
    prefilled_tokens: int = 0  # tokens computed by this request's prefill
    fetch_error: str | None = None
    fetch_stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    restored_kv: Any = None  # canonical KV view of the fetch's target, consumed by the prefill
    fetch_future: Any = None
    fetch_deadline_s: float | None = None  # the deadline the fetch ran under
    prefill_pos: int = 0  # prompt tokens already in `cache` (restored or prefilled)
    error: str | None = None  # why the request ended with finish_reason "error"
    # timing
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    fetch_start: float | None = None
    deadline_start: float | None = (
        None  # where the fetch's deadline counts from (its lookup's start), if not fetch_start
    )
    fetch_end: float | None = None
    scheduled_time: float | None = None  # admitted to the running batch
    prefill_start_time: float | None = None  # its first prefill forward called
    first_token_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    finish_time: float | None = None
    # model state
    cache: Any = None
    generator: Any = None
    # streaming: called from the engine thread as on_token(request, token_id) and on_finish(request)
    on_token: Callable[[Request, int], None] | None = None
    on_finish: Callable[[Request], None] | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def fetch_s(self) -> float | None:
        """Seconds from the start of the prefix fetch to its KV being restored (None: no fetch)."""
        if self.fetch_start is None or self.fetch_end is None:
            return None
        return self.fetch_end - self.fetch_start

    @property
    def restored_to_prefill_s(self) -> float | None:
        """Seconds from the prefix KV being restored to the suffix prefill starting (None: no fetch)."""
        if self.fetch_end is None or self.prefill_start_time is None:
            return None
        return self.prefill_start_time - self.fetch_end

    @property
    def prefill_to_first_token_s(self) -> float | None:
        """Seconds from the (suffix) prefill starting to the first token being sampled."""
        if self.prefill_start_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.prefill_start_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first one."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED

    @property
    def prefilling(self) -> bool:
        """Admitted but its prompt is not all in the cache yet (chunked prefill)."""
        return not self.output_ids and self.state is State.RUNNING


@dataclasses.dataclass
class RequestOutput:
    """What `Engine.generate` returns per prompt."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    ttft_s: float | None
    tpot_s: float | None
    matched_tokens: int
    restored_tokens: int
    prefilled_tokens: int
    fetch_error: str | None
    bytes_fetched: int
    fetch_s: float | None = None  # from the fetch's start to its KV being restored (None: no fetch)
    restored_to_prefill_s: float | None = None  # restored KV -> suffix prefill started (None: no fetch)
    prefill_to_first_token_s: float | None = None  # suffix prefill started -> first token sampled

    @classmethod
    def from_request(cls, req: Request, text: str) -> RequestOutput:
        return cls(
            request_id=req.request_id,
            prompt_ids=list(req.prompt_ids),
            token_ids=list(req.output_ids),
            text=text,
            finish_reason=req.finish_reason,
            ttft_s=req.ttft,
            tpot_s=req.tpot,
            matched_tokens=req.matched_tokens,
            restored_tokens=req.restored_tokens,
            prefilled_tokens=req.prefilled_tokens,
            fetch_error=req.fetch_error,
            bytes_fetched=int(req.fetch_stats.get("bytes_fetched", 0) or 0),
            fetch_s=req.fetch_s,
            restored_to_prefill_s=req.restored_to_prefill_s,
            prefill_to_first_token_s=req.prefill_to_first_token_s,
        )
