"""`kvcodec ingest --ray ADDRESS`: the same job on a Ray cluster (the optional `ray` extra).

Prefill actors (one per GPU of the cluster, or CPU actors on a cluster without GPUs) tokenize each
document, skip those already stored and prefill the others; the KV goes into Ray's object store and
an encode task on CPUs codes and writes it to the shared store (Redis, Redis Cluster, a folder every
node mounts). Tokens, keys and chunk bytes are those of a one-machine `ingest` with the same model,
codec and options: the stored objects are byte-identical. As there, results are reported in document
order (a result waits for those of the documents before it, so one long document holds back the
progress of the others), a repeat of a document this job
stores is not stored again (it settles with the first one's store; an actor told of the stores in
flight does not prefill it), and after a store error the driver waits for the store (run.wait_for_store)
before it goes on or stops (asked from a task on the cluster, whose nodes reach the store); a document
whose store failed while the store was down is stored once more when it answers (its KV is still in
Ray's object store: no second prefill).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvcodec.errors import ConfigError, StoreError
from kvcodec.ingest.run import (
    FAILED,
    SKIPPED,
    STORE_PATIENCE_S,
    STORED,
    DocResult,
    IngestReport,
    StoreDownError,
    _Cut,
    _Prefill,
    _why,
    token_digest,
    wait_for_store,
)
from kvcodec.ingest.sources import Document
from kvcodec.models.registry import token_limit

INSTALL_HINT = "kvcodec ingest --ray needs Ray: pip install 'kvcodec[ray]'"


@dataclasses.dataclass(frozen=True)
class RayJob:
    """What every actor and task of a job needs to rebuild its part (sent to the cluster)."""

    model: str  # registered name, model folder or .gguf file, readable on every node
    store_url: str
    codec: str
    codec_options: tuple[tuple[str, Any], ...] = ()
    max_tokens: int | None = None
    prefill_chunk_tokens: int | None = 2048
    encode_cpus: int = 4  # CPUs an encode task takes (its chunk threads)
    threads: int | None = None  # torch threads of a CPU prefill actor (None: Ray's default)
    dtype: str | None = None  # the prefill's dtype by name (None: kvcodec.models.run_dtype's rule)

    def make_codec(self):  # noqa: ANN201 - a ChunkCodec
        from kvcodec.codecs import make_codec

        return make_codec(self.codec, **dict(self.codec_options))

    def open_cache(self, model_id: str, device: Any = "cpu") -> tuple[Any, Any]:
        """(store, PrefixCache) as the engine opens them for this codec and model."""
        from kvcodec.engine.config import EngineConfig
        from kvcodec.fetcher import PrefixCache
        from kvcodec.store import open_store

        cfg = EngineConfig(store_url=self.store_url)
        store = open_store(self.store_url)
        return store, PrefixCache(store, model_id, self.make_codec(), device, store_partial=cfg.store_partial)


def import_ray():  # noqa: ANN201 - the ray module
    try:
        import ray
    except ImportError as e:
        raise ConfigError(f"{INSTALL_HINT} ({e})") from None
    return ray


class Prefiller:
    """A prefill actor: the model on this actor's GPU (or the CPU), the tokenizer, a store handle
    for the resume lookups."""

    def __init__(self, job: RayJob) -> None:
        import torch

        from kvcodec.engine.tokens import Tokens
        from kvcodec.ingest.run import load_for_ingest
        from kvcodec.models import model_id

        if job.threads:
            torch.set_num_threads(job.threads)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        run_dtype = getattr(torch, job.dtype) if job.dtype else None
        model, tokenizer, _ = load_for_ingest(job.model, device, run_dtype)
        self.job, self.model_id = job, model_id(model)
        cut = _Cut(token_limit(model, job.max_tokens), given=job.max_tokens is not None)
        self.unopened = _Prefill(Tokens(tokenizer), cut, _Storing({}), None, model, job.prefill_chunk_tokens)
        self.read: _Prefill | None = None  # with the store's cache, once the store opened

    def prefill(self, doc: Document, storing: dict[bytes, str]) -> tuple[tuple[DocResult, list[int] | None, str], Any]:
        """((result, token ids or None, model id), KV on the CPU or None): run._Prefill's answer, where
        `storing` (token digest -> document id) names the documents whose store is in flight."""
        try:
            read = self._opened()
        except StoreError as e:  # the store is down (at the actor's start too): the driver waits for it
            return (DocResult(doc.id, FAILED, error=_why(e), store_down=True), None, self.model_id), None
        result, ids, kv = dataclasses.replace(read, seen=_Storing(storing))(doc)
        return (result, ids, self.model_id), (kv.to("cpu") if kv is not None else None)

    def _opened(self) -> _Prefill:
        if self.read is None:
            _, cache = self.job.open_cache(self.model_id)
            self.read = dataclasses.replace(self.unopened, cache=cache)
        return self.read


@dataclasses.dataclass(frozen=True)
class _Storing:
    """The documents whose store is in flight, as run._Prefill asks of a job's _Seen."""

    ids_of: dict[bytes, str]

    def first(self, ids: list[int]) -> str | None:
        return self.ids_of.get(token_digest(ids))


def store_kv(job: RayJob, model_id: str, ids: list[int], kv: Any) -> tuple[int, float]:
    """An encode task: code `kv` and write it under the engine's keys; (chunks written, seconds)."""
    t = time.perf_counter()
    os.environ["KVCODEC_ENCODE_WORKERS"] = str(job.encode_cpus)
    store, cache = job.open_cache(model_id)
    try:
        written = int(cache.put(ids, kv) or 0)
    finally:
        if hasattr(store, "close"):
            store.close()
    return written, time.perf_counter() - t


def cluster_gpus(ray: Any) -> int:
    return int(ray.cluster_resources().get("GPU", 0))


def ingest_on_ray(
    documents: Iterable[Document],
    job: RayJob,
    *,
    actors: int | None = None,
    on_result: Callable[[DocResult], None] | None = None,
    store_patience_s: float = STORE_PATIENCE_S,
) -> IngestReport:
    """Run `job` over `documents` on the Ray cluster this process is connected to (ray.init).
    actors: prefill actors (default: one per GPU of the cluster, or one on the CPU without GPUs).
    At most two documents per actor wait for prefill and two encodes per actor run at once.
    store_patience_s: as run.ingest's (StoreDownError once the stores in flight are done)."""
    ray = import_ray()
    gpus = cluster_gpus(ray)
    n = actors or max(1, gpus)
    node_cpus = max((int(node["Resources"].get("CPU", 0)) for node in ray.nodes() if node.get("Alive")), default=0)
    total_cpus = int(ray.cluster_resources().get("CPU", 0))
    if total_cpus - (0 if gpus else n) < 1:
        raise ConfigError(
            f"the Ray cluster has {total_cpus} CPUs and no GPU: {n} prefill actors on the CPU leave none for encoding"
        )
    # a task must fit a node (a CPU actor holds one CPU of its node)
    job = dataclasses.replace(job, encode_cpus=max(1, min(job.encode_cpus, node_cpus - (0 if gpus else 1))))
    per_actor = {"num_gpus": 1} if gpus else {"num_cpus": 1}
    remote_actor = ray.remote(Prefiller).options(**per_actor)
    pool = [remote_actor.remote(job) for _ in range(n)]
    run = _RayRun(ray, job, ray.remote(store_kv).options(num_cpus=job.encode_cpus), on_result, store_patience_s)
    t0 = time.perf_counter()
    try:
        run.run(documents, pool)
    finally:
        for actor in pool:
            ray.kill(actor)
    return IngestReport(tuple(run.results), time.perf_counter() - t0)


@dataclasses.dataclass
class _Prefilling:
    actor: Any
    kv: Any  # the KV's object ref
    index: int  # the document's place in the job: results are reported in this order
    doc: Document
    again: bool  # read again after its lookup failed


@dataclasses.dataclass(frozen=True)
class _InStore:
    """A document whose encode task is in flight: what reports it, and what stores it once more."""

    index: int  # the document's place in the job
    result: DocResult  # its prefill's result
    digest: bytes  # its tokens' (token_digest)
    model_id: str
    ids: list[int]
    kv: Any  # the KV's object ref, held until the store is done
    retried: bool = False  # stored once more after an outage


@dataclasses.dataclass
class _RayRun:
    """The driver's loop: documents to the actors (two in flight each), prefilled KV to encode tasks
    (two per actor at once), results reported in document order (as on one machine); repeats settle
    with their first store."""

    ray: Any
    job: RayJob
    encode: Any  # the remote store_kv
    on_result: Callable[[DocResult], None] | None
    store_patience_s: float
    results: list[DocResult] = dataclasses.field(default_factory=list)
    prefills: dict[Any, _Prefilling] = dataclasses.field(default_factory=dict)  # meta ref ->
    stores: dict[Any, _InStore] = dataclasses.field(default_factory=dict)  # encode task ref ->
    storing: dict[bytes, tuple[str, Any]] = dataclasses.field(default_factory=dict)  # digest -> (doc id, store ref)
    repeats: dict[Any, list[tuple[int, DocResult]]] = dataclasses.field(default_factory=dict)  # store ref -> repeats
    stored: dict[bytes, str] = dataclasses.field(default_factory=dict)  # digest -> doc id, stores done
    held: dict[int, DocResult] = dataclasses.field(default_factory=dict)  # results behind an unreported document
    reported: int = 0  # documents reported so far: the next to report is this index

    def run(self, documents: Iterable[Document], pool: list[Any]) -> None:
        queue = collections.deque((i, doc, False) for i, doc in enumerate(documents))
        idle = collections.deque(a for a in pool for _ in range(2))  # two documents in flight per actor
        try:
            try:
                while queue or self.prefills or self.stores:
                    while queue and idle and len(self.stores) < len(pool) * 2:
                        self._prefill(idle.popleft(), *queue.popleft())
                    ref = self.ray.wait([*self.prefills, *self.stores], num_returns=1)[0][0]
                    if ref in self.prefills:
                        idle.append(self.prefills[ref].actor)
                        self._prefilled(ref, queue)
                    else:
                        self._stored(ref, wait=True)
            except (KeyboardInterrupt, StoreDownError):
                while self.stores:  # counted, so that the interrupted run's report says what is stored
                    self._stored(self.ray.wait(list(self.stores), num_returns=1)[0][0], wait=False)
                raise
        finally:  # however the job ends (a second interrupt in the drain too): nothing finished goes unreported
            self._report_held()

    def _prefill(self, actor: Any, index: int, doc: Document, again: bool) -> None:
        storing = {digest: doc_id for digest, (doc_id, _) in self.storing.items()}
        meta, kv = actor.prefill.options(num_returns=2).remote(doc, storing)
        self.prefills[meta] = _Prefilling(actor, kv, index, doc, again)

    def _prefilled(self, ref: Any, queue: collections.deque) -> None:
        p = self.prefills.pop(ref)
        result, ids, model_id = _get(self.ray, ref)
        if result.store_down and not p.again:  # its lookup failed: read again once the store answers
            self._wait_for_store((p.index, result))
            queue.appendleft((p.index, p.doc, True))
        elif ids is None:
            self._done(p.index, result)
            if result.store_down:
                self._wait_for_store()
        elif (digest := token_digest(ids)) in self.storing:  # a repeat, or its twin prefilled beside it
            first, stored = self.storing[digest]
            skipped = dataclasses.replace(result, status=SKIPPED, error=f"the same tokens as {first}")
            self.repeats.setdefault(stored, []).append((p.index, skipped))
        elif digest in self.stored:  # its first document's store finished while it was prefilled
            skipped = dataclasses.replace(result, status=SKIPPED, error=f"the same tokens as {self.stored[digest]}")
            self._done(p.index, skipped)
        elif result.status == SKIPPED:  # its first document's store failed since: read it again
            queue.appendleft((p.index, p.doc, p.again))
        else:
            self._store(_InStore(p.index, result, digest, model_id, ids, p.kv), p.doc.id)

    def _store(self, s: _InStore, doc_id: str, repeats: list[tuple[int, DocResult]] | None = None) -> None:
        """An encode task for `s`; `repeats` (index, result) settle with it."""
        ref = self.encode.remote(self.job, s.model_id, s.ids, s.kv)
        if repeats:
            self.repeats[ref] = repeats
        self.storing[s.digest] = (doc_id, ref)
        self.stores[ref] = s  # last: what the drain waits for holds all of it

    def _stored(self, ref: Any, wait: bool) -> None:
        s = self.stores[ref]  # taken off once its result is in: an interrupt leaves it to the drain
        try:
            chunks, store_s = _get(self.ray, ref)
        except Exception as e:  # noqa: BLE001 - one document's failure is reported, the job goes on
            self._taken(ref, s.digest)
            down = isinstance(e, StoreError)
            failed = dataclasses.replace(s.result, status=FAILED, error=_why(e), store_down=down)
            if not (down and wait):
                self._failed(s.index, failed, self.repeats.pop(ref, []))
                return
            repeats = self.repeats.pop(ref, [])
            try:
                self._wait_for_store()
            except BaseException:
                self._failed(s.index, failed, repeats)
                raise
            if s.retried:  # its second store failed too, the store answering again since
                self._failed(s.index, failed, repeats)
            else:  # its store failed while the store was down: once more, now it answers
                self._retry(dataclasses.replace(s, retried=True), failed, repeats)
            return
        self._taken(ref, s.digest)
        self._done(
            s.index, dataclasses.replace(s.result, chunks=chunks, store_s=store_s, status=STORED if chunks else SKIPPED)
        )
        self.stored.setdefault(s.digest, s.result.id)
        for i, r in self.repeats.pop(ref, []):
            self._done(i, r)

    def _retry(self, s: _InStore, failed: DocResult, repeats: list[tuple[int, DocResult]]) -> None:
        try:
            self._store(s, s.result.id, repeats)
        except BaseException:  # not in flight (an interrupt while it was submitted): reported as failed
            if not any(v is s for v in self.stores.values()):
                self.storing.pop(s.digest, None)
                self._failed(s.index, failed, repeats)
            raise

    def _failed(self, index: int, failed: DocResult, repeats: list[tuple[int, DocResult]]) -> None:
        self._done(index, failed)
        for i, r in repeats:
            self._done(i, dataclasses.replace(r, status=FAILED, error=f"{r.error}, whose store failed"))

    def _taken(self, ref: Any, digest: bytes) -> None:
        del self.stores[ref], self.storing[digest]

    def _done(self, index: int, r: DocResult) -> None:
        """Document `index`'s result, reported once every document before it is."""
        self.held[index] = r
        while self.reported in self.held:
            self._report(self.held.pop(self.reported))
            self.reported += 1

    def _report_held(self) -> None:
        """The job stops: the results held behind documents that will not finish, in document order."""
        for index in sorted(self.held):
            self._report(self.held.pop(index))

    def _report(self, r: DocResult) -> None:
        self.results.append(r)
        if self.on_result:
            self.on_result(r)

    def _wait_for_store(self, unreported: tuple[int, DocResult] | None = None) -> None:
        """run.wait_for_store, in a task on the cluster; where it stops, `unreported` (index, result) is
        reported first."""
        try:  # asked from the cluster, whose nodes reach the store (the driver may not)
            probe = self.ray.remote(wait_for_store_at).options(num_cpus=0)
            _get(self.ray, probe.remote(self.job.store_url, self.store_patience_s))
        except (StoreDownError, KeyboardInterrupt):
            if unreported is not None:
                self._done(*unreported)
            raise


def wait_for_store_at(url: str, patience_s: float) -> None:
    """A task: run.wait_for_store on the store at `url` (a store that cannot be opened is down too)."""
    store = _StoreAt(url)
    try:
        wait_for_store(store, patience_s)
    finally:
        store.close()


class _StoreAt:
    """The store at `url`, opened when first asked (opening a store that is down fails as asking it does)."""

    def __init__(self, url: str) -> None:
        self.url, self._store = url, None

    def exists_many(self, keys: list[str]) -> list[bool]:
        if self._store is None:
            from kvcodec.store import open_store

            self._store = open_store(self.url)
        return self._store.exists_many(keys)

    def close(self) -> None:
        if self._store is not None and hasattr(self._store, "close"):
            self._store.close()


def _get(ray: Any, ref: Any) -> Any:
    """ray.get, with a task's own exception raised as itself (a KVCodecError keeps its message)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        raise (cause if isinstance(cause, BaseException) else e) from None
