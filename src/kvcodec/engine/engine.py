"""The inference engine: a running batch stepped one token at a time, with remote prefix reuse.

    >>> from kvcodec.engine import Engine
    >>> eng = Engine("smollm2-135m", store_url="file:///tmp/kv", max_batch=4)
    >>> out = eng.generate([long_doc + "\\nQ: ...", long_doc + "\\nQ: ..."], max_new_tokens=32)

Each iteration (`step`): the scheduler admits requests to the running batch (a request whose
prefix KV is being fetched joins only once it is restored); admitted requests start from their
restored prefix; at most `prefill_chunk_tokens` prompt tokens are prefilled per iteration while
other requests decode, else up to `max_prefill_tokens` (a request samples its first token when its
whole prompt is in); every other running request decodes one token. A request that fails (in its prefill, decode or sampling) ends alone with finish reason
"error"; the others go on. After a prefill the prompt's KV is encoded and stored in the background.
`generate` drives steps on the caller's thread; `start()` runs them on a background thread for
online serving (`submit` + streaming callbacks).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvcodec.engine import gcfreeze
from kvcodec.engine.config import AUTO, EngineConfig
from kvcodec.engine.deadline import PrefillRate
from kvcodec.engine.metrics import EngineMetrics
from kvcodec.engine.prefix import RestoreTargets, chunk_tokens_of, open_prefix_cache
from kvcodec.engine.runner import ModelRunner, default_device, sample
from kvcodec.engine.scheduler import Scheduler
from kvcodec.engine.sequence import Request, RequestOutput, SamplingParams
from kvcodec.engine.storer import KVStorer
from kvcodec.engine.tokens import Tokens
from kvcodec.engine.validate import check_context, check_sampling, check_token_ids, sampling_params
from kvcodec.errors import ConfigError
from kvcodec.kvspec.serving import layout_for
from kvcodec.models.check import check_codable
from kvcodec.models.local import kvt_of_another_model

log = logging.getLogger(__name__)
FORWARD_ALLOWANCE = 4.0  # /health: a prefill forward may take this many times its predicted time beyond stall_s


def _warn_if_kvt_of_another_model(codec: Any, model: str) -> None:
    """A logged warning where the transform codec's .kvt was calibrated on another model than `model`
    (serve and the CLI say so on stderr): its shape may fit, its accuracy is another model's."""
    other = kvt_of_another_model(codec, model)
    if other is not None:
        log.warning(
            "the .kvt was calibrated on %r, the engine serves %r: its quality report does not apply "
            "(calibrate on %r for one that does)",
            other,
            model,
            model,
        )


def _load(model: Any, tokenizer: Any, device: torch.device, dtype: torch.dtype | None) -> tuple[Any, Any]:
    """(model, tokenizer) on `device` in `dtype`, else the model's own dtype with float32 weights as
    float16 on a GPU (kvcodec.models.placement): a name loads in that dtype, a model object is cast."""
    if isinstance(model, str):
        from kvcodec.models import load_for_device

        model, tok = load_for_device(model, device, dtype=dtype)
        return model, tokenizer if tokenizer is not None else tok
    from kvcodec.models.placement import place_model

    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    return place_model(model, device, dtype), tokenizer


MASKED_PIECE_ELEMENTS = 1 << 30  # [piece, cache] mask entries of a piece after the first: ~3 GB with its float copy


def masked_piece_tokens(prompt_len: int, floor: int) -> int:
    """Tokens of a prefill piece after the first, which attends to the cache through a dense
    [piece, cache] mask (and its float copy): bounded so the mask stays near
    MASKED_PIECE_ELEMENTS entries (a 128k prompt's second piece: 8192 tokens, not 65536 and a
    25 GB mask), never below `floor`."""
    return max(1, floor, MASKED_PIECE_ELEMENTS // max(1, prompt_len))


class Engine:
    """Generation with iteration-level scheduling and fetch-aware prefix reuse.

    model: a name for kvcodec.models.load_model ("smollm2-135m", ...) or a loaded transformers
        causal LM (then pass `tokenizer` unless the model carries `.tokenizer`).
    config: an EngineConfig; keyword arguments replace its fields (Engine(model, max_batch=4)).
    prefix_cache: an already built kvcodec.fetcher.PrefixCache (or anything with lookup / fetch /
        put); it replaces the one the config's store_url and codec would give.
    """

    def __init__(
        self,
        model: Any = "smollm2-135m",
        config: EngineConfig | None = None,
        *,
        tokenizer: Any = None,
        prefix_cache: Any = None,
        **kwargs: Any,
    ) -> None:
        cfg = self.config = EngineConfig.from_kwargs(config, **kwargs)
        self.device = torch.device(cfg.device) if cfg.device is not None else default_device()
        keeps_kv = cfg.reuse or cfg.store_policy.enabled
        if keeps_kv and isinstance(model, str):
            check_codable(model)  # from its config, before minutes of loading weights
            _warn_if_kvt_of_another_model(cfg.codec, model)
        model, tokenizer = _load(model, tokenizer, self.device, cfg.dtype)
        self.runner = ModelRunner(model, self.device, cfg.sdpa_backends)
        self.model, self.tokens = self.runner.model, Tokens(tokenizer)
        self.tokenizer = tokenizer
        self.max_context = cfg.max_context or self.runner.max_positions
        self.metrics = EngineMetrics()
        self.store = None
        layout = self.runner.layout = layout_for(self.model, self.device) if keeps_kv else None
        store_url = None  # worker processes encode stores where they can open the same store
        if prefix_cache is None and keeps_kv:
            self.store, prefix_cache = open_prefix_cache(cfg, self.model, self.device, layout)
            store_url = cfg.store_url
        self.prefix_cache = prefix_cache
        self.chunk_tokens = chunk_tokens_of(prefix_cache, getattr(cfg.codec_config, "chunk_tokens", 256))
        self.prefill_rate = PrefillRate()
        self.scheduler = Scheduler(
            prefix_cache if cfg.reuse else None,
            policy=cfg.policy,
            max_batch=cfg.max_batch,
            max_prefill_tokens=cfg.max_prefill_tokens,
            min_reuse_tokens=cfg.min_reuse_tokens,
            fetch_workers=cfg.fetch_workers,
            deadline_for=self._deadline_for,
            target_for=RestoreTargets(self.model, self.device, self.runner.dtype, layout) if cfg.reuse else None,
        )
        self.storer = KVStorer(
            prefix_cache, cfg.store_policy, self.chunk_tokens, max_pending=cfg.store_queue, store_url=store_url
        )
        self.storer.on_done, self.storer.on_drop = self._stored, self.metrics.stores_dropped.inc
        self.storer.on_stored, self.storer.on_skip = self._prefix_stored, self.metrics.stores_skipped.inc
        self.metrics.store_backlog.set_function(lambda: self.storer.backlog)
        self.metrics.store_backlog_tokens.set_function(lambda: self.storer.backlog_tokens)
        self.metrics.store_encode_processes.set_function(lambda: getattr(self.storer.processes, "processes", 0))
        self.eos_ids = self.tokens.eos_ids(self.model)
        self._loop: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self._step_lock = threading.Lock()
        self._last_progress = time.monotonic()
        self._forward_allowance_s = 0.0  # a prefill forward under way may run this long beyond stall_s
        self._measure_prefill()  # the fetch deadline's rate, and /health's allowance for a prefill under way
        if cfg.reuse and prefix_cache is not None:  # kernels and pinned staging before the first fetch
            prefix_cache.warm_up(self.runner.dtype, self.max_context)
        self._gc_lock = threading.Lock()
        self._gc_held = cfg.freeze_gc
        if self._gc_held:
            gcfreeze.hold()

    # ---- setup ---------------------------------------------------------------------------------
    @property
    def batch_decode(self) -> bool:
        return self.config.batch_decode

    def _measure_prefill(self, tokens: int = 32) -> None:
        """Seed the prefill rate (and warm the model up) before the first fetch needs a deadline and the
        first long prompt /health's allowance; a model this fails on is measured by its first prompts."""
        req = Request(prompt_ids=[0] * tokens, params=SamplingParams(max_new_tokens=1))
        try:
            for _ in range(2):  # the first forward pays one-time setup costs
                self.runner.begin_prefill(req)
                t0 = time.perf_counter()
                self.runner.prefill_chunk(req, tokens)
                elapsed = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - a measurement, not a request
            log.warning("could not measure the prefill rate at start (%s): the first prompts will", e)
            return
        self.prefill_rate.observe(tokens, elapsed)

    def _deadline_for(self, req: Request, tokens: int) -> float | None:
        d = self.config.fetch_deadline_s
        return self.prefill_rate.deadline_s(tokens) if d == AUTO else d

    # ---- requests ------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return self.tokens.encode(prompt)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat conversation through the tokenizer's chat template."""
        return self.tokens.chat_ids(messages)

    def decode_text(self, ids: Sequence[int]) -> str:
        return self.tokens.decode(ids)

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ConfigError unless the request can run (parameters, vocabulary, context)."""
        check_sampling(params)
        check_token_ids(prompt_ids, self.runner.vocab_size)
        check_context(len(prompt_ids), params.max_new_tokens, self.max_context)

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        reuse: bool = True,
        store: bool = True,
        on_token: Callable[[Request, int], None] | None = None,
        on_finish: Callable[[Request], None] | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Check and queue a request (its prefix lookup runs on this thread); returns it at once.

        arrival_time: when the request arrived (`time.perf_counter()`; a server passes when it
        received it); default now, before tokenizing, so its TTFT includes the tokenizer.
        """
        if self._closed:
            raise ConfigError("this engine is closed")
        if params is not None and not isinstance(params, SamplingParams):
            raise ConfigError(f"params must be a SamplingParams; got {type(params).__name__}")
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        req = Request(prompt_ids=self.encode(prompt), params=params or SamplingParams(), reuse=reuse, store=store)
        req.arrival_time = arrival
        self.check(req.prompt_ids, req.params)
        if request_id:
            req.request_id = request_id
        req.on_token, req.on_finish = on_token, on_finish
        if req.params.temperature > 0:
            req.generator = torch.Generator(device="cpu")
            req.generator.manual_seed(req.params.seed if req.params.seed is not None else int(time.time_ns() % 2**63))
        self.scheduler.add(req)
        if self.scheduler.prefix_cache is not None and req.reuse and req.prompt_len >= 2:
            (self.metrics.reuse_hits if req.matched_tokens else self.metrics.reuse_misses).inc()
        return req

    def abort(self, req: Request, reason: str = "abort") -> None:
        """Stop a request at the next step, finishing with `reason`: 'abort' (its client went away)
        or 'stop' (the server found a stop string in its text). The first reason given stands."""
        if not req.aborted:
            req.abort_reason = reason
        req.aborted = True
        with self.scheduler.cv:
            self.scheduler.cv.notify_all()

    # ---- one iteration -------------------------------------------------------------------------
    def step(self) -> int:
        """Admit, prefill (one chunk budget) and decode once. Returns the number of tokens produced."""
        with self._step_lock:
            for req in self.scheduler.take_aborted():
                self._finish(req, req.abort_reason)
            admitted = self.scheduler.schedule()
            for req in [r for r in self.scheduler.running if r.aborted]:
                self._finish(req, req.abort_reason)
            decoding = [r for r in self.scheduler.running if r.output_ids]
            for req in admitted:
                self._guard(req, self._admit, req)
            produced = self._prefill_some(bool(decoding)) + self._decode(decoding)
            for state, n in self.scheduler.counts().items():
                self.metrics.queue.labels(state).set(n)
            self._last_progress = time.monotonic()
            return produced

    def _guard(self, req: Request, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args); if it raises, `req` alone ends with finish reason 'error'."""
        try:
            return fn(*args)
        except Exception as e:
            log.exception("request %s failed", req.request_id)
            req.error = f"{type(e).__name__}: {e}"
            if not req.finished:
                self._finish(req, "error")
            return None

    def _admit(self, req: Request) -> None:
        self._account_fetch(req)
        self.runner.begin_prefill(req)
        self.metrics.restored_tokens.inc(req.restored_tokens)

    def _prefill_some(self, others_decoding: bool) -> int:
        """Prefill prompt tokens, oldest request first: at most prefill_chunk_tokens while other
        requests are decoding (they wait for this step), else up to max_prefill_tokens: a prompt
        cut into pieces costs more in all (each piece attends to the cache through a mask)."""
        cfg = self.config
        budget = cfg.prefill_chunk_tokens if others_decoding else max(cfg.prefill_chunk_tokens, cfg.max_prefill_tokens)
        produced = 0
        for req in [r for r in self.scheduler.running if r.prefilling]:
            if budget <= 0:
                break
            n = min(budget, req.prompt_len - req.prefill_pos)
            if req.prefill_pos > 0:
                n = min(n, masked_piece_tokens(req.prompt_len, cfg.prefill_chunk_tokens))
            budget -= n
            produced += bool(self._guard(req, self._prefill_chunk, req, n))
        return produced

    def _prefill_chunk(self, req: Request, n: int) -> bool:
        t0 = time.perf_counter()
        if req.prefill_start_time is None:
            req.prefill_start_time = t0
            if req.restored_to_prefill_s is not None:
                self.metrics.restored_to_prefill.observe(req.restored_to_prefill_s)
        self._forward_allowance_s = FORWARD_ALLOWANCE * (self.prefill_rate.deadline_s(n) or 0.0)
        try:
            logits = self.runner.prefill_chunk(req, n)
        finally:
            self._forward_allowance_s = 0.0
            self._last_progress = time.monotonic()  # a piece prefilled is progress
        self.prefill_rate.observe(n, time.perf_counter() - t0)
        self.metrics.prefill_tokens.inc(n)
        if logits is None:
            return False
        layout = self.runner.layout
        kv = None
        if req.store and self.prefix_cache is not None:
            try:
                kv = layout.snapshot(req.cache) if layout is not None else req.cache
            except Exception as e:  # never fail a request because storing failed
                log.warning("could not queue KV store: %s", e)
        if layout is not None:
            layout.after_prefill(req.cache)
        self._append(req, sample(logits, req.params, req.generator))
        if kv is not None:  # queued after the first token: storing never adds to the TTFT
            try:
                self.storer.submit(req.prompt_ids, kv, restored=req.restored_tokens)
            except Exception as e:
                log.warning("could not queue KV store: %s", e)
        return True

    def _decode(self, reqs: list[Request]) -> int:
        reqs = [r for r in reqs if not r.finished]
        if not reqs:
            return 0
        if self.config.batch_decode and len(reqs) > 1 and self.runner.layout is None and self.runner.batchable:
            try:
                logits = self.runner.decode_batched(reqs)
            except Exception as e:  # find the request that breaks it: one by one below
                log.exception("batched decode failed; decoding one by one")
                broken = getattr(e, "broken", ())  # runner.BatchedAppendError: caches it could not put back
                for r in broken:
                    r.error = f"{type(e).__name__}: {e}"
                    self._finish(r, "error")
                reqs = [r for r in reqs if r not in broken]
            else:
                return sum(bool(self._guard(r, self._emit, r, lg)) for r, lg in zip(reqs, logits))
        return sum(bool(self._guard(r, self._decode_one, r)) for r in reqs)

    def _decode_one(self, req: Request) -> bool:
        return self._emit(req, self.runner.decode([req])[0])

    def _emit(self, req: Request, logits: torch.Tensor) -> bool:
        self._append(req, sample(logits, req.params, req.generator))
        return True

    def _account_fetch(self, req: Request) -> None:
        if not req.matched_tokens:
            return
        st = req.fetch_stats or {}
        self.metrics.bytes_fetched.inc(int(st.get("bytes_fetched", st.get("bytes", 0)) or 0))
        if req.fetch_s is not None:
            self.metrics.fetch_seconds.observe(req.fetch_s)
        if req.fetch_error is not None or req.restored_tokens < min(req.matched_tokens, req.prompt_len - 1):
            self.metrics.fetch_fallbacks.inc()

    def _append(self, req: Request, token: int) -> None:
        now = time.perf_counter()
        req.output_ids.append(token)
        req.token_times.append(now)
        self.metrics.generated_tokens.inc()
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.ttft.observe(req.ttft)
            if req.prefill_to_first_token_s is not None:
                self.metrics.prefill_to_first_token.observe(req.prefill_to_first_token_s)
        _callback(req.on_token, req, token)
        p = req.params
        if (not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids:
            self._finish(req, "stop")
        elif len(req.output_ids) >= p.max_new_tokens:
            self._finish(req, "length")

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        req.cache = req.restored_kv = None
        self.scheduler.finish(req)
        self.metrics.requests.labels(reason).inc()
        if req.tpot is not None:
            self.metrics.tpot.observe(req.tpot)
        req.done.set()
        _callback(req.on_finish, req)

    def _stored(self, written: int | None, error: Exception | None) -> None:
        if error is not None:
            self.metrics.store_errors.inc()
        elif written:
            self.metrics.stored_chunks.inc(written)

    def _prefix_stored(self, tokens: int, lag_s: float) -> None:
        self.metrics.stored_prefixes.inc()
        self.metrics.stored_tokens.inc(tokens)
        self.metrics.store_lag.observe(lag_s)

    # ---- drivers -------------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        *,
        params: SamplingParams | None = None,
        reuse: bool = True,
        store: bool = True,
        wait_for_store: bool = False,
        **kw: Any,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs in prompt order.

        wait_for_store: return only after the prompts' KV is in the store (so that a following call
        can reuse it).
        """
        if not isinstance(prompts, (str, Sequence)) or isinstance(prompts, (bytes, bytearray)):
            raise ConfigError(f"prompts are text, token ids, or a list of either; got {type(prompts).__name__}")
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        sp = (
            params
            if params is not None
            else sampling_params(max_new_tokens=max_new_tokens, temperature=temperature, **kw)
        )
        if not isinstance(sp, SamplingParams):
            raise ConfigError(f"params must be a SamplingParams; got {type(sp).__name__}")
        arrival = time.perf_counter()  # TTFT counts the tokenizer
        ids = [self.encode(p) for p in ([prompts] if single else list(prompts))]
        for one in ids:  # every prompt checked before any is queued: a refused batch leaves no request behind
            self.check(one, sp)
        reqs = [
            self.submit(one, dataclasses.replace(sp), reuse=reuse, store=store, arrival_time=arrival) for one in ids
        ]
        if self._loop is not None:
            for r in reqs:
                r.done.wait()
        else:
            while not all(r.finished for r in reqs):
                if self.scheduler.wait_for_work(timeout=0.5):
                    self.step()
        if wait_for_store:
            self.storer.flush()
        return [RequestOutput.from_request(r, self.decode_text(r.output_ids)) for r in reqs]

    def start(self) -> None:
        """Run steps on a background thread until stop() (for serving)."""
        if self._closed:
            raise ConfigError("this engine is closed")
        if self._loop is not None:
            return
        self.storer.start()  # encode workers up before the first request's store
        self._stop.clear()
        self._last_progress = time.monotonic()
        self._loop = threading.Thread(target=self._run, name="kvcodec-engine", daemon=True)
        self._loop.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.scheduler.wait_for_work(timeout=0.05):
                self._last_progress = time.monotonic()  # idle is not stalled
                continue
            try:
                self.step()
            except Exception:  # a fault outside any one request: fail the running batch, go on
                log.exception("engine step failed")
                for req in list(self.scheduler.running):
                    self._finish(req, "error")

    def health(self) -> dict[str, Any]:
        """{"ok", "stalled_s", "limit_s", "alive", "queue"}: not ok when the step loop died, or made no
        progress for limit_s seconds while requests were waiting to run: config.stall_s, and while a
        prefill forward runs, FORWARD_ALLOWANCE times its predicted time more (a long prompt's one
        forward on a slow device is work, not a stall)."""
        counts = self.scheduler.counts()
        alive = self._loop is None or self._loop.is_alive()
        busy = bool(counts["running"] or counts["waiting"] or counts["ready"])
        since = time.monotonic() - self._last_progress if busy else 0.0
        limit = self.config.stall_s + self._forward_allowance_s
        return {"ok": alive and since < limit, "stalled_s": since, "limit_s": limit, "alive": alive, "queue": counts}

    def stop(self, abort: bool = False) -> None:
        """Stop the step loop after its current step; abort=True also ends every unfinished request
        (finish reason 'abort') so that nothing waits for them."""
        self._stop.set()
        loop = self._loop
        if loop is not None:  # stop() may run on two threads at once (signal handler, shutdown)
            loop.join()
            self._loop = None
        if abort:
            with self._step_lock:
                for req in self.scheduler.drain():
                    req.aborted = True  # a fetch still under way for it stops where it is
                    if not req.finished:
                        self._finish(req, "abort")

    def close(self, wait_for_store: bool = True) -> None:
        """Stop and release everything; wait_for_store=False drops queued stores and fetches. Requests
        not finished end with reason 'abort' (a thread waiting in generate returns); a closed engine
        takes no more requests."""
        if self._closed:
            return
        self._closed = True
        try:
            self.stop(abort=True)
            if wait_for_store:
                self.storer.flush()
            self.storer.shutdown(wait=wait_for_store)
            self.scheduler.shutdown(wait=wait_for_store)
            if self.store is not None and hasattr(self.store, "close"):
                self.store.close()
        finally:
            self._release_gc()

    def _release_gc(self) -> None:
        with self._gc_lock:
            held, self._gc_held = self._gc_held, False
        if held:
            gcfreeze.release()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _callback(fn: Callable[..., Any] | None, *args: Any) -> None:
    if fn is None:
        return
    try:
        fn(*args)
    except Exception as e:
        log.warning("callback %s failed: %s", getattr(fn, "__name__", fn), e)
