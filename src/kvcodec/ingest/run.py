"""Prefill documents and store their prefix KV: the model prefills one document while the chunks
of the previous ones are encoded (in parallel over the cores, kvcodec.codecs.hevc.encode) and
written in worker processes (engine/encode_pool.py: each takes a document's KV from shared memory,
encodes it over its threads and writes it; given the store's URL), or on background threads of
this process.

Documents are tokenized as the engine tokenizes a prompt and stored under the engine's keys
(same model id, codec and options), so a later request that begins with a document restores its
KV. A document whose KV is already stored is skipped after one lookup (resume); one that fails
(unreadable, empty, too long for the model, a store error) is reported and the job goes on.
"""

from __future__ import annotations

import array
import collections
import contextlib
import dataclasses
import functools
import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvcodec.errors import ConfigError, KVCodecError, StoreError
from kvcodec.ingest.sources import Document
from kvcodec.layout.search import encode_workers
from kvcodec.models.registry import token_limit

log = logging.getLogger(__name__)

STORED, SKIPPED, FAILED = "stored", "skipped", "failed"
STORE_PATIENCE_S = 120.0  # how long a job waits for a store that stopped answering before it stops
_STORE_PROBE = "kvcodec-ingest-probe"  # a key asked about, never written


class StoreDownError(StoreError):
    """The store did not answer again within the job's patience: the job stopped (run it again to resume)."""


@dataclasses.dataclass(frozen=True)
class DocResult:
    id: str
    status: str  # stored | skipped | failed
    tokens: int = 0
    chunks: int = 0  # chunks written (0 for skipped)
    error: str | None = None
    prefill_s: float = 0.0
    store_s: float = 0.0  # encode + write
    kv_bytes: int = 0  # bytes of the KV prefilled (in the model's dtype)
    store_down: bool = False  # it failed on a store error (the job waits for the store before going on)


@dataclasses.dataclass(frozen=True)
class IngestReport:
    results: tuple[DocResult, ...]
    seconds: float
    encoded_in: str | None = None  # "processes" or "threads" (None: not said)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def stored_tokens(self) -> int:
        return sum(r.tokens for r in self.results if r.status == STORED)

    def to_dict(self) -> dict[str, Any]:
        return {
            "documents": len(self.results),
            "stored": self.count(STORED),
            "skipped": self.count(SKIPPED),
            "failed": self.count(FAILED),
            "stored_tokens": self.stored_tokens,
            "chunks": sum(r.chunks for r in self.results),
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.stored_tokens / self.seconds, 1) if self.seconds > 0 else None,
            "prefill_s": round(sum(r.prefill_s for r in self.results), 3),
            "store_s": round(sum(r.store_s for r in self.results), 3),
            "kv_mb_per_s": round(sum(r.kv_bytes for r in self.results if r.status == STORED) / self.seconds / 1e6, 1)
            if self.seconds > 0
            else None,
            "encoded_in": self.encoded_in,
            "errors": [{"id": r.id, "error": r.error} for r in self.results if r.status == FAILED],  # ids may repeat
        }


def _stored_already(cache: Any, ids: list[int]) -> bool:
    """Whether every chunk a put of `ids` would write is in the store whole: its meta, and its blobs of the
    sizes the meta records (a store that evicts drops a chunk's blobs before its meta, which was written
    last; a damaged chunk is dropped by the lookup, so the put rewrites it). KVCodecError for a document
    too short to store anything (shorter than a chunk where partial chunks are not stored)."""
    want = len(ids)
    if not getattr(cache, "store_partial", True):
        want -= want % int(cache.chunk_tokens)
        if want == 0:
            raise KVCodecError(
                f"the document's {len(ids)} tokens are fewer than a chunk ({cache.chunk_tokens}): nothing to store "
                "without partial chunks"
            )
    return cache.lookup(ids, whole=True) >= want


def load_for_ingest(model_name: str, device: Any = None, dtype: Any = None) -> tuple[Any, Any, Any]:
    """(model, tokenizer, device) as ingest prefills, as the engine runs it (kvcodec.models.load_for_device:
    float32 weights load as float16 for a GPU; `dtype`, a torch dtype, overrides that); device None: the
    engine's default (a GPU if there is one)."""
    import torch

    from kvcodec.engine.runner import default_device
    from kvcodec.models import load_for_device

    dev = torch.device(device) if device else default_device()
    model, tokenizer = load_for_device(model_name, dev, dtype=dtype)
    return model, tokenizer, dev


def _prefill(model: Any, ids: list[int], chunk_tokens: int | None) -> Any:
    import torch

    from kvcodec.integrations.hf import cache_to_tensor, forward_ids

    with torch.inference_mode():
        _, kv_cache = forward_ids(model, torch.tensor(ids), chunk_tokens=chunk_tokens)
        return cache_to_tensor(kv_cache)


def ingest(
    documents: Iterable[Document],
    model: Any,
    tokenizer: Any,
    cache: Any,
    *,
    max_tokens: int | None = None,
    prefill_chunk_tokens: int | None = 2048,
    store_workers: int | None = None,
    on_result: Callable[[DocResult], None] | None = None,
    store_url: str | None = None,
    encode_in: str = "processes",
    store_patience_s: float = STORE_PATIENCE_S,
) -> IngestReport:
    """Prefill each document with `model` and store its KV through `cache` (a PrefixCache).

    max_tokens: keep at most this many leading tokens of a document (None: the model's context; a
        longer document fails, since no request that begins with it fits the model).
    store_patience_s: after a document fails on a store error, how long the job waits for the store
        to answer again before it stops (StoreDownError, after the documents in flight are done;
        running it again resumes); it goes on as soon as the store answers.
    store_workers: documents encoded and written at once; at most store_workers + 1 prefilled KVs
        wait for the encoder, bounding memory. None: enough documents that their chunks fill the
        encode threads (a document's chunks are encoded in parallel; one 2k-token document has 8
        chunks of 256 tokens, so 16 cores take 2 at once), at least 1.
    on_result: called with each document's result as it is known (for progress bars).
    store_url: the URL `cache`'s store was opened from; with encode_in="processes" (and a store
        other processes can open: not memory://, a codec that can cross) documents are encoded
        in worker processes (a thread per core in all, split so that a document's chunks fill a
        worker's threads: encode_pool.split_workers; each encodes one document at a time), else
        on threads of this process."""
    from kvcodec.engine.tokens import Tokens

    limit = token_limit(model, max_tokens)
    chunk_tokens = int(getattr(cache, "chunk_tokens", 0) or 256)
    cores = encode_workers()
    chunks = -(-limit // chunk_tokens) if limit else None  # a whole document's chunks, at most
    procs = _encode_pool(cache, store_url, encode_in, cores, store_workers, chunks)
    job = _Job(
        prefill=_Prefill(
            Tokens(tokenizer), _Cut(limit, given=max_tokens is not None), _Seen(), cache, model, prefill_chunk_tokens
        ),
        put=functools.partial(_store_in, procs, cache) if procs else functools.partial(_store, cache),
        at_once=_AtOnce(procs.processes + 1 if procs else None, store_workers, cores, chunk_tokens),
        on_result=on_result,
        store_patience_s=store_patience_s,
    )
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if procs:  # shut down after the threads that feed it
            stack.callback(procs.shutdown)
            procs.start()  # the workers spawn and import while the first document is tokenized and prefilled
        pool_size = procs.processes if procs else max(1, store_workers or cores)
        job.run(documents, stack.enter_context(ThreadPoolExecutor(pool_size, thread_name_prefix="kvcodec-ingest")))
    return IngestReport(tuple(job.results), time.perf_counter() - t0, "processes" if procs else "threads")


@dataclasses.dataclass(frozen=True)
class _AtOnce:
    """Documents encoding, or waiting with their KV, at once: a worker process each and one waiting to
    take the first free one (`processes`), else documents_at_once on this process's threads."""

    processes: int | None
    store_workers: int | None
    cores: int
    chunk_tokens: int

    def __call__(self, ids: list[int]) -> int:
        if self.processes:
            return self.processes
        return documents_at_once(self.store_workers, self.cores, -(-len(ids) // self.chunk_tokens))


@dataclasses.dataclass
class _Job:
    """One ingest run: each document prefilled on this thread, its store submitted to `pool`; results
    reported in document order as the stores finish; after a store error, the job waits for the store."""

    prefill: _Prefill  # its cache is the one stored into
    put: Callable[[list[int], Any], tuple[int, float]]
    at_once: Callable[[list[int]], int]
    on_result: Callable[[DocResult], None] | None
    store_patience_s: float
    results: list[DocResult] = dataclasses.field(default_factory=list)
    inflight: collections.deque[tuple[Future, DocResult, list[int]]] = dataclasses.field(
        default_factory=collections.deque
    )

    def run(self, documents: Iterable[Document], pool: ThreadPoolExecutor) -> None:
        try:
            for doc in documents:
                self._take(doc, pool)
            self._settle(0)
        except (KeyboardInterrupt, StoreDownError):
            if self.inflight:
                log.warning("interrupted: finishing the %d documents in flight", len(self.inflight))
            self._settle(0, wait=False)  # counted, so that the interrupted run's report says what is stored
            raise

    def _take(self, doc: Document, pool: ThreadPoolExecutor) -> None:
        result, ids, kv = self._read(doc)
        if kv is None and ids is not None:  # a repeat: reported once its first document's store is
            self.inflight.append((self.prefill.seen.store_of(ids), result, ids))
            self._settle(self.at_once(ids))
        elif kv is None and self.inflight and not result.store_down:  # reported behind the stores before it
            self.inflight.append((_settled(), result, []))
        elif kv is None:
            self._done(result)
            if result.store_down:
                self._wait_for_store()
        else:
            stored = pool.submit(self.put, ids, kv)
            self.prefill.seen.add(ids, doc.id, stored)
            self.inflight.append((stored, result, ids))
            del kv
            self._settle(self.at_once(ids))

    def _read(self, doc: Document) -> tuple[DocResult, list[int] | None, Any]:
        """prefill(doc); where its lookup failed, once more after the store answers again."""
        result, ids, kv = self.prefill(doc)
        if not result.store_down:
            return result, ids, kv
        try:
            self._wait_for_store()
        except (StoreDownError, KeyboardInterrupt):
            self._done(result)
            raise
        return self.prefill(doc)

    def _settle(self, keep: int, wait: bool = True) -> None:
        """Report the oldest stores until `keep` are in flight; after a store error, wait for the store (`wait`)."""
        while self.inflight and (not self.inflight[0][2] or self._counted() > keep):
            fut, r, ids = self.inflight[0]  # taken off once its result is in: an interrupt while waiting leaves it
            result = self._outcome(fut, r, ids)
            self.inflight.popleft()
            if result.store_down and wait:
                try:
                    self._wait_for_store()
                except BaseException:
                    self._done(result)
                    raise
                if r.status == STORED:  # its store failed while the store was down: once more, now it answers
                    try:
                        result = self._again(r, ids)
                    except BaseException:
                        self._done(result)
                        raise
            self._done(result)

    def _counted(self) -> int:
        """Stores and repeats in flight: the queued results but those only kept in order (no token ids)."""
        return sum(bool(ids) for _, _, ids in self.inflight)

    def _outcome(self, fut: Future, r: DocResult, ids: list[int]) -> DocResult:
        if r.status == FAILED:  # failed before its prefill, queued only to keep the order
            return r
        # a repeat settles with the store of its first document (or of its retry); a document stored before, at once
        repeat = r.status == SKIPPED
        if repeat and ids:
            fut = self.prefill.seen.current(ids) or fut
        try:
            chunks, store_s = fut.result()
        except Exception as e:  # noqa: BLE001 - one document's failure is reported, the job goes on
            if repeat:
                return dataclasses.replace(r, status=FAILED, error=f"{r.error}, whose store failed")
            self.prefill.seen.forget(ids)  # a later repeat is tried again
            return dataclasses.replace(r, status=FAILED, error=_why(e), store_down=isinstance(e, StoreError))
        if repeat:
            return r
        return dataclasses.replace(r, chunks=chunks, store_s=store_s, status=STORED if chunks else SKIPPED)

    def _again(self, r: DocResult, ids: list[int]) -> DocResult:
        """Document `r` (token ids `ids`) prefilled and stored again, here (its KV was let go once submitted)."""
        try:
            kv = _prefill(self.prefill.model, ids, self.prefill.chunk_tokens)
            chunks, store_s = self.put(ids, kv)
        except Exception as e:  # noqa: BLE001 - reported per document
            self.prefill.seen.forget(ids)
            return dataclasses.replace(r, status=FAILED, error=_why(e), store_down=isinstance(e, StoreError))
        self.prefill.seen.add(ids, r.id, _settled())
        return dataclasses.replace(r, chunks=chunks, store_s=store_s, status=STORED if chunks else SKIPPED)

    def _done(self, r: DocResult) -> None:
        self.results.append(r)
        if self.on_result:
            self.on_result(r)

    def _wait_for_store(self) -> None:
        wait_for_store(self.prefill.cache.store, self.store_patience_s)


def _settled() -> Future:
    """A Future done already (no chunks written): a result that waits only for the ones before it."""
    done: Future = Future()
    done.set_result((0, 0.0))
    return done


@dataclasses.dataclass(frozen=True)
class _Prefill:
    """A document tokenized as the engine tokenizes a prompt, cut, and prefilled."""

    tokens: Any  # engine.tokens.Tokens
    cut: _Cut
    seen: Any  # .first(ids): the id of a document this job stores with the same tokens, or None (_Seen)
    cache: Any
    model: Any
    chunk_tokens: int | None  # tokens per forward

    def __call__(self, doc: Document) -> tuple[DocResult, list[int] | None, Any]:
        """(its result so far, token ids, KV); a repeat of one this job stores: (its result, token ids,
        None); a failed, empty or already stored one: (its final result, None, None)."""
        if doc.error:
            return DocResult(doc.id, FAILED, error=doc.error), None, None
        try:
            ids = self.cut(self.tokens.encode(doc.text))
            if not ids:
                raise KVCodecError("the document tokenizes to no tokens")
            if (first := self.seen.first(ids)) is not None:  # settled with that document's store (ids, no KV)
                return DocResult(doc.id, SKIPPED, len(ids), error=f"the same tokens as {first}"), ids, None
            if _stored_already(self.cache, ids):
                return DocResult(doc.id, SKIPPED, len(ids)), None, None
            t = time.perf_counter()
            kv = _prefill(self.model, ids, self.chunk_tokens)
            prefill_s = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 - reported per document
            return DocResult(doc.id, FAILED, error=_why(e), store_down=isinstance(e, StoreError)), None, None
        kv_bytes = kv.numel() * kv.element_size()
        return DocResult(doc.id, STORED, len(ids), prefill_s=prefill_s, kv_bytes=kv_bytes), ids, kv


@dataclasses.dataclass(frozen=True)
class _Cut:
    """A document's tokens as stored: at most `limit`; longer than the model's context (no
    max_tokens `given`) is an error, since no request that begins with the document fits the model."""

    limit: int | None
    given: bool

    def __call__(self, ids: list[int]) -> list[int]:
        if self.limit and len(ids) > self.limit and not self.given:
            raise KVCodecError(
                f"{len(ids)} tokens; the model's context holds {self.limit}: give --max-tokens to store the first ones"
            )
        return ids[: self.limit or None]


class _Seen:
    """The token sequences this job stores (a 16-byte digest each, with the first document's id and
    its store's future): a repeat is not prefilled again; it is skipped once that store is done, or
    fails with it (and a repeat after a failed store is tried again)."""

    def __init__(self) -> None:
        self._first: dict[bytes, tuple[str, Future]] = {}

    def first(self, ids: list[int]) -> str | None:
        """The id of the document this job stores with the same tokens, if any."""
        entry = self._first.get(token_digest(ids))
        return entry[0] if entry else None

    def store_of(self, ids: list[int]) -> Future:
        return self._first[token_digest(ids)][1]

    def current(self, ids: list[int]) -> Future | None:
        """The store of these tokens now (a retry's, after the first failed), or None."""
        entry = self._first.get(token_digest(ids))
        return entry[1] if entry else None

    def add(self, ids: list[int], doc_id: str, stored: Future) -> None:
        self._first.setdefault(token_digest(ids), (doc_id, stored))

    def forget(self, ids: list[int]) -> None:
        self._first.pop(token_digest(ids), None)


def token_digest(ids: list[int]) -> bytes:
    """16 bytes that tell a document's token ids from another's."""
    return hashlib.blake2b(array.array("q", ids).tobytes(), digest_size=16).digest()


def wait_for_store(store: Any, patience_s: float, first_wait_s: float = 0.5) -> None:
    """Return once `store` answers an existence query; StoreDownError after `patience_s` seconds of
    asking (waits doubling from `first_wait_s`, at most 8 s)."""
    end, wait = time.monotonic() + patience_s, first_wait_s
    while True:
        try:
            store.exists_many([_STORE_PROBE])
            return
        except Exception as e:  # noqa: BLE001 - any failure to answer is the store still down
            left = end - time.monotonic()
            if left <= 0:
                raise StoreDownError(
                    f"the store did not answer for {patience_s:g} s ({_why(e)}): stopped; run the same command to resume"
                ) from None
            log.warning("the store does not answer (%s): asking again in %.1f s", _why(e), min(wait, left))
            time.sleep(min(wait, left))
            wait = min(wait * 2, 8.0)


def documents_at_once(store_workers: int | None, cores: int, chunks: int) -> int:
    """Documents whose KV may be encoded at once: store_workers, or (None) as many documents of
    `chunks` chunks as it takes to give every one of `cores` encode threads a chunk."""
    if store_workers:
        return max(1, store_workers)
    return max(1, -(-cores // max(1, chunks)))


def _store(cache: Any, ids: list[int], kv: Any) -> tuple[int, float]:
    t = time.perf_counter()
    written = int(cache.put(ids, kv) or 0)
    return written, time.perf_counter() - t


def _encode_pool(
    cache: Any, store_url: str | None, encode_in: str, cores: int, store_workers: int | None, chunks: int | None
) -> Any:
    """An EncodePool for ingest (every core, at the engine's priority: nothing else runs; the
    threads split in processes for documents of `chunks` chunks, None: STORE_CHUNKS), or None."""
    from kvcodec.engine.encode_pool import STORE_CHUNKS, EncodePool, split_workers, worker_spec
    from kvcodec.engine.storer import ENCODE_IN

    if encode_in not in ENCODE_IN:
        raise ConfigError(f"encode_in must be one of {ENCODE_IN}; got {encode_in!r}")
    if encode_in != "processes":
        return None
    processes, threads = split_workers(cores, store_workers, min(chunks or STORE_CHUNKS, STORE_CHUNKS))
    spec = worker_spec(cache, store_url, threads, 0)
    return EncodePool(spec, processes) if spec is not None else None


def _store_in(procs: Any, cache: Any, ids: list[int], kv: Any) -> tuple[int, float]:
    """_store in a worker process of `procs`; on this thread where the processes are down."""
    from kvcodec.engine.encode_pool import EncodeProcessError

    t = time.perf_counter()
    try:
        written, _ = procs.put(ids, kv)
    except EncodeProcessError:
        return _store(cache, ids, kv)
    return written, time.perf_counter() - t


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if not isinstance(e, KVCodecError) else str(e)
