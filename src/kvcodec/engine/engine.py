"""The inference engine: a running batch stepped one token at a time, with remote prefix reuse.

    >>> from kvcodec.engine import Engine
    >>> eng = Engine("smollm2-135m", store_url="file:///tmp/kv")
    >>> out = eng.generate([long_doc + "\\nQ: ...", long_doc + "\\nQ: ..."], max_new_tokens=32)

Each iteration (`step`): the scheduler admits requests to the running batch (a request whose
prefix KV is being fetched joins only once it is restored); admitted requests prefill their
non-restored prompt tokens and sample their first token; every other running request decodes one
token. After a prefill the prompt's KV is encoded and stored in the background for later requests.
`generate` drives steps on the caller's thread; `start()` runs them on a background thread for
online serving (`submit` + streaming callbacks).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvcodec.engine.metrics import EngineMetrics
from kvcodec.engine.runner import ModelRunner, default_device, sample
from kvcodec.engine.sequence import Request, RequestOutput, SamplingParams
from kvcodec.engine.storer import KVStorer, StorePolicy
from kvcodec.scheduler import Scheduler

log = logging.getLogger(__name__)


def _load(model: Any, tokenizer: Any, device: torch.device, dtype: torch.dtype | None) -> tuple[Any, Any]:
    if isinstance(model, str):
        from kvcodec.models import load_model

        model, tok = load_model(model)
        tokenizer = tokenizer or tok
    if tokenizer is None:
        tokenizer = getattr(model, "tokenizer", None)
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.float16
    model = model.to(device=device, dtype=dtype)
    return model, tokenizer


class Engine:
    """Generation with iteration-level scheduling and fetch-aware prefix reuse.

    model: a name for kvcodec.models.load_model ("smollm2-135m", "qwen2.5-coder-0.5b") or a loaded
        transformers causal LM (then pass `tokenizer` unless the model carries `.tokenizer`).
    store_url: KV store (file://, memory://, redis://); None with reuse=True means an in-process
        memory:// store. Ignored when `prefix_cache` is given.
    codec_config: kvcodec.CodecConfig for stored KV (default: int8).
    reuse: look up and fetch stored prefixes. store_policy: what to store after prefills
        (StorePolicy or None for defaults; StorePolicy(enabled=False) stores nothing).
    policy: "fetch-aware" (default) or "blocking" (fetch on the engine thread, for comparison).
    prefix_cache: an already built kvcodec.fetcher.PrefixCache (or anything with lookup/fetch/put),
        e.g. one reading through an emulated slow link (store_url="throttle://1?inner=..." does too).
    prefix_cache_options: extra keyword arguments for the PrefixCache built from store_url
        (policy="fixed:0", codec=RawCodec(), ...).
    batch_decode: one forward for the whole running batch per decode step (left-padded); False runs
        one forward per request.
    """

    def __init__(
        self,
        model: Any = "smollm2-135m",
        *,
        tokenizer: Any = None,
        store_url: str | None = None,
        codec_config: Any = None,
        reuse: bool = True,
        store_policy: StorePolicy | None = None,
        policy: str = "fetch-aware",
        max_batch: int = 8,
        max_prefill_tokens: int = 8192,
        min_reuse_tokens: int = 1,
        fetch_deadline_s: float | None = None,
        fetch_workers: int = 2,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        prefix_cache: Any = None,
        prefix_cache_options: dict[str, Any] | None = None,
        batch_decode: bool = True,
    ) -> None:
        self.device = torch.device(device) if device is not None else default_device()
        model, self.tokenizer = _load(model, tokenizer, self.device, dtype)
        self.runner = ModelRunner(model, self.device)
        self.model = self.runner.model
        self.batch_decode = batch_decode
        self.metrics = EngineMetrics()
        self.reuse = reuse
        self.codec_config = codec_config
        self.store = None
        if prefix_cache is None and (reuse or (store_policy is None or store_policy.enabled)):
            prefix_cache = self._open_prefix_cache(store_url, codec_config, prefix_cache_options or {})
        self.prefix_cache = prefix_cache
        chunk = getattr(getattr(prefix_cache, "config", None), "chunk_tokens", None) or getattr(
            codec_config, "chunk_tokens", 256
        )
        self.chunk_tokens = int(chunk)
        self.scheduler = Scheduler(
            prefix_cache if reuse else None,
            policy=policy,
            max_batch=max_batch,
            max_prefill_tokens=max_prefill_tokens,
            min_reuse_tokens=min_reuse_tokens,
            fetch_workers=fetch_workers,
            fetch_deadline_s=fetch_deadline_s,
        )
        self.storer = KVStorer(prefix_cache, store_policy or StorePolicy(), self.chunk_tokens)
        self.storer.on_done = self._stored
        self.eos_ids = self._eos_ids()
        self._loop: threading.Thread | None = None
        self._stop = threading.Event()
        self._step_lock = threading.Lock()

    # ---- setup ---------------------------------------------------------------------------------
    def _open_prefix_cache(self, store_url: str | None, codec_config: Any, options: dict[str, Any]) -> Any:
        from kvcodec.config import CodecConfig
        from kvcodec.fetcher import PrefixCache
        from kvcodec.models import model_id
        from kvcodec.store import open_store

        self.store = open_store(store_url or "memory://")
        cfg = codec_config or CodecConfig(quant="int8")
        self.codec_config = cfg
        return PrefixCache(self.store, model_id(self.model), cfg, self.device, **options)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), getattr(self.model, "config", None), self.tokenizer):
            v = getattr(src, "eos_token_id", None)
            if v is None:
                continue
            ids.update(v if isinstance(v, (list, tuple, set)) else [v])
        return {int(i) for i in ids}

    # ---- requests ------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                from kvcodec.errors import ConfigError

                raise ConfigError("this engine has no tokenizer: pass token ids")
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        return [int(t) for t in prompt]

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat conversation through the tokenizer's chat template."""
        tmpl = getattr(self.tokenizer, "chat_template", None)
        if tmpl:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self.encode(text)

    def decode_text(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

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
    ) -> Request:
        """Queue a request (its prefix lookup runs on this thread); returns it at once."""
        req = Request(prompt_ids=self.encode(prompt), params=params or SamplingParams(), reuse=reuse, store=store)
        if request_id:
            req.request_id = request_id
        if not req.prompt_ids:
            from kvcodec.errors import ConfigError

            raise ConfigError("empty prompt")
        req.on_token, req.on_finish = on_token, on_finish
        if req.params.temperature > 0:
            req.generator = torch.Generator(device="cpu")
            req.generator.manual_seed(req.params.seed if req.params.seed is not None else int(time.time_ns() % 2**63))
        self.scheduler.add(req)
        if self.scheduler.prefix_cache is not None and req.reuse and req.prompt_len >= 2:
            (self.metrics.reuse_hits if req.matched_tokens else self.metrics.reuse_misses).inc()
        return req

    # ---- one iteration -------------------------------------------------------------------------
    def step(self) -> int:
        """Admit, prefill and decode once. Returns the number of tokens produced."""
        with self._step_lock:
            admitted = self.scheduler.schedule()
            for req in [r for r in self.scheduler.running if r.aborted and r not in admitted]:
                self._finish(req, "abort")
            decoding = [r for r in self.scheduler.running if r not in admitted]
            produced = 0
            for req in admitted:
                self._account_fetch(req)
                logits = self.runner.prefill(req)
                self.metrics.restored_tokens.inc(req.restored_tokens)
                self.metrics.prefill_tokens.inc(req.prefilled_tokens)
                if req.store and self.prefix_cache is not None:
                    try:
                        self.storer.submit(req.prompt_ids, req.cache, restored=req.restored_tokens)
                    except Exception as e:  # never fail a request because storing failed
                        log.warning("could not queue KV store: %s", e)
                self._append(req, sample(logits, req.params, req.generator))
                produced += 1
            if decoding:
                run = self.runner.decode_batched if self.batch_decode else self.runner.decode
                for req, logits in zip(decoding, run(decoding)):
                    self._append(req, sample(logits, req.params, req.generator))
                    produced += 1
            for state, n in self.scheduler.counts().items():
                self.metrics.queue.labels(state).set(n)
            return produced

    def _account_fetch(self, req: Request) -> None:
        if not req.matched_tokens:
            return
        st = req.fetch_stats or {}
        nbytes = st.get("bytes_fetched", st.get("bytes", 0)) or 0
        self.metrics.bytes_fetched.inc(int(nbytes))
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
        if req.on_token is not None:
            try:
                req.on_token(req, token)
            except Exception as e:
                log.warning("on_token callback failed: %s", e)
        p = req.params
        if not p.ignore_eos and token in self.eos_ids:
            self._finish(req, "stop")
        elif token in p.stop_token_ids:
            self._finish(req, "stop")
        elif len(req.output_ids) >= p.max_new_tokens:
            self._finish(req, "length")

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        req.cache = None
        self.scheduler.finish(req)
        self.metrics.requests.labels(reason).inc()
        if req.tpot is not None:
            self.metrics.tpot.observe(req.tpot)
        req.done.set()
        if req.on_finish is not None:
            try:
                req.on_finish(req)
            except Exception as e:
                log.warning("on_finish callback failed: %s", e)

    def abort(self, req: Request) -> None:
        """Stop a request (client went away); it finishes with reason 'abort' at the next step."""
        req.aborted = True

    def _stored(self, written: int | None, error: Exception | None) -> None:
        if error is not None:
            self.metrics.store_errors.inc()
        elif written:
            self.metrics.stored_chunks.inc(written)

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
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        plist = [prompts] if single else list(prompts)
        reqs = []
        for p in plist:
            sp = params or SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, **kw)
            reqs.append(self.submit(p, SamplingParams(**vars(sp)), reuse=reuse, store=store))
        if self._loop is not None:
            for r in reqs:
                r.done.wait()
        else:
            while not all(r.finished for r in reqs):
                if not self.scheduler.wait_for_work(timeout=0.5):
                    continue
                self.step()
        if wait_for_store:
            self.storer.flush()
        return [RequestOutput.from_request(r, self.decode_text(r.output_ids)) for r in reqs]

    def start(self) -> None:
        """Run steps on a background thread until stop() (for serving)."""
        if self._loop is not None:
            return
        self._stop.clear()
        self._loop = threading.Thread(target=self._run, name="kvcodec-engine", daemon=True)
        self._loop.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.scheduler.wait_for_work(timeout=0.05):
                continue
            try:
                self.step()
            except Exception:  # keep serving; fail the requests of the batch that broke
                log.exception("engine step failed")
                for req in list(self.scheduler.running):
                    self._finish(req, "error")

    def stop(self) -> None:
        self._stop.set()
        if self._loop is not None:
            self._loop.join()
            self._loop = None

    def close(self) -> None:
        self.stop()
        self.storer.flush()
        self.storer.shutdown()
        self.scheduler.shutdown()
        if self.store is not None and hasattr(self.store, "close"):
            self.store.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
