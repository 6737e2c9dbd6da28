"""`kvcodec ingest`: documents from a folder, JSONL or a prompt list (with a template) prefilled by
a real model and stored under the engine's keys; a second run skips them (resume); a bad
document is reported without stopping the job."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvcodec.codecs import make_codec
from kvcodec.engine.tokens import Tokens
from kvcodec.errors import ConfigError
from kvcodec.fetcher import PrefixCache
from kvcodec.fetcher.keys import blob_key
from kvcodec.ingest import ingest, read_documents
from kvcodec.models import model_id
from kvcodec.store import open_store

DOCS = [
    "The river ran past the old mill, where the miller kept a canoe tied to a post. " * 3,
    "A lighthouse keeper counted ships at night and wrote each name in a blue book. " * 3,
]


def test_sources_read_folders_jsonl_and_prompt_lists_with_a_template(tmp_path):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("second")
    (folder / "sub" / "a.md").write_text("first")
    (folder / "skip.bin").write_bytes(b"\x00")
    assert [(d.id, d.text) for d in read_documents(folder)] == [("b.txt", "second"), ("sub/a.md", "first")]
    jl = tmp_path / "c.jsonl"
    jl.write_text('{"id": "x", "text": "one"}\n"two"\n{not json\n{"body": 1}\n')
    got = list(read_documents(jl, template="Q: {text} A:"))
    assert [(d.id, d.text) for d in got[:2]] == [("x", "Q: one A:"), ("line 2", "Q: two A:")]
    assert got[2].error.startswith("not JSON") and "no string field" in got[3].error
    prompts = tmp_path / "p.txt"
    prompts.write_text("alpha\n\nbeta\n")
    assert [d.text for d in read_documents(prompts)] == ["alpha", "beta"]
    with pytest.raises(ConfigError, match="text"):
        list(read_documents(prompts, template="no placeholder"))


def test_json_lines_by_either_name_are_records_and_a_json_file_or_blank_text_is_refused(tmp_path):
    # .ndjson was read as prompts: each line's JSON text stored, which no request begins with
    for name in ("c.ndjson", "c.JSONL"):
        (tmp_path / name).write_text('{"id": "x", "text": "one"}\n{"id": "y", "text": "  \\n "}\n')
        got = list(read_documents(tmp_path / name))
        assert (got[0].id, got[0].text) == ("x", "one") and "white space" in got[1].error
    (tmp_path / "a.json").write_text('[{"text": "one"}]')
    with pytest.raises(ConfigError, match="JSON Lines"):
        list(read_documents(tmp_path / "a.json"))
    (tmp_path / "p.txt").write_text("alpha\n \t \nbeta\n")
    assert [d.text for d in read_documents(tmp_path / "p.txt")] == ["alpha", "beta"]  # a blank line is no prompt


def test_the_report_names_every_failed_document_even_where_ids_repeat(tmp_path):
    # errors were a dict by id: two failed documents of id "x" were one entry; a null id was named "None"
    from kvcodec.ingest.run import FAILED, DocResult, IngestReport

    jl = tmp_path / "d.jsonl"
    jl.write_text(
        "\n".join(
            json.dumps(r) for r in ({"id": "x", "text": "a"}, {"id": "x", "text": "b"}, {"id": None, "text": "c"})
        )
    )
    ids = [d.id for d in read_documents(jl)]
    assert ids == ["x", "x", "line 3"]
    report = IngestReport(tuple(DocResult(i, FAILED, error=f"bad {n}") for n, i in enumerate(ids)), 1.0).to_dict()
    assert report["failed"] == 3 and report["errors"] == [
        {"id": "x", "error": "bad 0"},
        {"id": "x", "error": "bad 1"},
        {"id": "line 3", "error": "bad 2"},
    ]


def test_ingest_stores_under_engine_keys_resumes_and_reports_bad_documents(smollm2, tmp_path):
    model, tokenizer = smollm2
    jl = tmp_path / "docs.jsonl"
    jl.write_text("\n".join([json.dumps({"id": "mill", "text": DOCS[0]}), "{broken", json.dumps({"text": ""})]))
    jl.write_text(jl.read_text() + "\n" + json.dumps({"id": "light", "text": DOCS[1]}) + "\n")
    codec = make_codec("hevc", chunk_tokens=32)
    cache = PrefixCache(open_store(f"file://{tmp_path / 'store'}"), model_id(model), codec, "cpu")
    seen = []
    report = ingest(list(read_documents(jl)), model, tokenizer, cache, on_result=seen.append)
    s = report.to_dict()
    assert (s["stored"], s["skipped"], s["failed"]) == (2, 0, 2) and len(seen) == 4
    errors = {e["id"]: e["error"] for e in s["errors"]}
    assert len(s["errors"]) == 2 and set(errors) == {"line 2", "line 3"} and "empty" in errors["line 3"]
    for text in DOCS:  # a request beginning with the document finds all of it
        ids = Tokens(tokenizer).encode(text)
        assert cache.lookup(ids + [13, 14]) == len(ids) - len(ids) % 32
    again = ingest(list(read_documents(jl)), model, tokenizer, cache).to_dict()
    assert (again["stored"], again["skipped"], again["failed"]) == (0, 2, 2)
    # a store that evicts drops a chunk's blob before its meta (written last): that document is stored again
    ids = Tokens(tokenizer).encode(DOCS[1])
    cache.store.delete(blob_key(cache.keys(ids)[1], 0))
    assert len(ids) > 32 and cache.lookup(ids) == len(ids) and cache.lookup(ids, whole=True) == 32
    third = ingest(list(read_documents(jl)), model, tokenizer, cache).to_dict()
    assert (third["stored"], third["skipped"], third["failed"]) == (1, 1, 2)
    assert cache.lookup(ids, whole=True) == len(ids)
    # a blob cut by damage is no stored chunk either: the resume stores that document again, not skips it
    mill = Tokens(tokenizer).encode(DOCS[0])
    cache.store.put(blob_key(cache.keys(mill)[0], 0), b"")
    fourth = ingest(list(read_documents(jl)), model, tokenizer, cache).to_dict()
    assert (fourth["stored"], fourth["skipped"], fourth["failed"]) == (1, 1, 2)
    assert cache.lookup(mill, whole=True) == len(mill) and cache.fetch(mill).tokens_restored == len(mill)


def test_an_interrupted_ingest_finishes_and_counts_the_documents_in_flight(smollm2, tmp_path):
    """Ctrl-C while two documents are being stored: both are finished and reported (so the
    interrupted run's report says what a resume will skip), no later document is started."""
    from kvcodec.ingest.sources import Document

    model, tokenizer = smollm2
    docs = [Document(f"d{i}", f"Document {i}: " + DOCS[i % 2]) for i in range(4)]
    cache = PrefixCache(open_store(f"file://{tmp_path}"), model_id(model), make_codec("raw", chunk_tokens=32), "cpu")
    seen = []

    def interrupt_at_the_first(r) -> None:  # noqa: ANN001 - a DocResult
        seen.append(r)
        if len(seen) == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ingest(docs, model, tokenizer, cache, encode_in="threads", store_workers=2, on_result=interrupt_at_the_first)
    assert [(r.id, r.status) for r in seen] == [("d0", "stored"), ("d1", "stored"), ("d2", "stored")]
    stored = [cache.lookup(Tokens(tokenizer).encode(d.text)) > 0 for d in docs]
    assert stored == [True, True, True, False]


def test_an_interrupt_while_waiting_for_a_store_counts_that_document_too(smollm2, tmp_path, monkeypatch):
    """Ctrl-C lands while the job waits for the oldest store's result: that document is still
    finished and counted with the others in flight (the interrupted run's report is complete)."""
    from concurrent.futures import Future

    from kvcodec.ingest.sources import Document

    model, tokenizer = smollm2
    docs = [Document(f"d{i}", f"Document {i}: " + DOCS[i % 2]) for i in range(4)]
    cache = PrefixCache(open_store(f"file://{tmp_path}"), model_id(model), make_codec("raw", chunk_tokens=32), "cpu")
    result, interrupted = Future.result, []

    def interrupt_once(self, timeout=None):  # noqa: ANN001, ANN202
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return result(self, timeout)

    monkeypatch.setattr(Future, "result", interrupt_once)
    seen = []
    with pytest.raises(KeyboardInterrupt):
        ingest(docs, model, tokenizer, cache, encode_in="threads", store_workers=2, on_result=seen.append)
    assert [(r.id, r.status) for r in seen] == [("d0", "stored"), ("d1", "stored"), ("d2", "stored")]


def test_ingest_command_summary_and_exit_code(tmp_path):
    from kvcodec.cli.main import cli

    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text(DOCS[0])
    store = f"file://{tmp_path / 'store'}"
    args = ["ingest", str(folder), "--model", "smollm2-135m", "--store", store, "--device", "cpu"]
    args += ["--codec", "raw", "--codec-option", "chunk_tokens=32", "--report", str(tmp_path / "r.json")]
    first = CliRunner().invoke(cli, args)
    assert first.exit_code == 0, first.output
    assert "1 stored, 0 already stored, 0 failed" in first.output
    second = CliRunner().invoke(cli, args)
    assert "0 stored, 1 already stored" in second.output
    assert json.loads((tmp_path / "r.json").read_text())["skipped"] == 1


def test_ingest_prefills_in_the_dtype_asked_and_stores_under_that_models_keys(smollm2, tmp_path):
    """A CPU ingest for a server that runs the model in another dtype: --dtype makes the keys match
    that server's (the model id names the dtype); the float32 model's keys do not find them."""
    import torch

    from kvcodec.cli.main import cli
    from kvcodec.models import load_for_device

    model, tokenizer = smollm2
    (tmp_path / "p.txt").write_text(DOCS[0] + "\n")
    store = f"file://{tmp_path / 'store'}"
    args = ["ingest", str(tmp_path / "p.txt"), "--model", "smollm2-135m", "--store", store, "--device", "cpu"]
    result = CliRunner().invoke(cli, [*args, "--dtype", "bfloat16", "--codec", "raw", "--chunk-tokens", "32"])
    assert result.exit_code == 0, result.output
    bf16, _ = load_for_device("smollm2-135m", "cpu", dtype=torch.bfloat16)
    assert f"in torch.bfloat16: stored under model id {model_id(bf16)}" in result.output
    ids = Tokens(tokenizer).encode(DOCS[0])
    codec = make_codec("raw", chunk_tokens=32)
    assert PrefixCache(open_store(store), model_id(bf16), codec, "cpu").lookup(ids) >= len(ids) - len(ids) % 32 > 0
    assert PrefixCache(open_store(store), model_id(model), codec, "cpu").lookup(ids) == 0


def test_a_transform_of_another_model_is_refused_before_any_document_is_prefilled(tmp_path, synthetic_kvt, monkeypatch):
    # each document was prefilled, then refused by the .kvt's shape: a whole corpus's prefill for nothing
    import kvcodec.ingest
    from kvcodec.cli.main import cli

    def never(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("documents were prefilled")

    monkeypatch.setattr(kvcodec.ingest, "ingest", never)
    (tmp_path / "p.txt").write_text("alpha\nbeta\n")
    args = ["ingest", str(tmp_path / "p.txt"), "--model", "smollm2-135m", "--store", f"file://{tmp_path / 's'}"]
    r = CliRunner().invoke(cli, [*args, "--device", "cpu", "--transform", str(synthetic_kvt)])
    assert r.exit_code == 2 and "does not fit smollm2-135m" in r.output, r.output


def test_an_interrupted_ingest_says_what_was_done_and_how_to_resume(tmp_path, monkeypatch):
    import kvcodec.ingest
    from kvcodec.cli.main import cli
    from kvcodec.ingest import DocResult

    def interrupted(documents, *args, on_result, **kw):  # Ctrl-C after the first document
        on_result(DocResult(documents[0].id, "stored", 10, 1))
        raise KeyboardInterrupt

    monkeypatch.setattr(kvcodec.ingest, "ingest", interrupted)
    (tmp_path / "p.txt").write_text("alpha\nbeta\n")
    args = ["ingest", str(tmp_path / "p.txt"), "--model", "smollm2-135m", "--store", f"file://{tmp_path / 's'}"]
    result = CliRunner().invoke(cli, [*args, "--device", "cpu", "--codec", "raw", "--report", str(tmp_path / "r.json")])
    assert result.exit_code == 130
    assert "interrupted after 1 stored, 0 skipped, 0 failed of 2 documents; run the same command" in result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["interrupted"] and (report["documents"], report["stored"], report["failed"]) == (2, 1, 0)
    assert report["done"] == 1 and report["errors"] == [] and report["stored_tokens"] == 10


def test_a_store_that_stays_down_stops_the_ingest_with_its_failures_in_the_report(tmp_path, monkeypatch):
    import kvcodec.ingest
    from kvcodec.cli.main import cli
    from kvcodec.ingest import DocResult
    from kvcodec.ingest.run import StoreDownError

    def store_down(documents, *args, on_result, **kw):
        on_result(DocResult(documents[0].id, "failed", error="StoreError: connection refused", store_down=True))
        raise StoreDownError("the store did not answer for 120 s: stopped; run the same command to resume")

    monkeypatch.setattr(kvcodec.ingest, "ingest", store_down)
    (tmp_path / "p.txt").write_text("alpha\nbeta\n")
    args = ["ingest", str(tmp_path / "p.txt"), "--model", "smollm2-135m", "--store", f"file://{tmp_path / 's'}"]
    result = CliRunner().invoke(cli, [*args, "--device", "cpu", "--codec", "raw", "--report", str(tmp_path / "r.json")])
    assert (
        result.exit_code == 1 and "run the same command to resume (0 stored, 0 skipped, 1 failed of 2" in result.output
    )
    report = json.loads((tmp_path / "r.json").read_text())
    assert not report["interrupted"] and "did not answer" in report["store_down"]
    assert report["errors"] == [{"id": "line 1", "error": "StoreError: connection refused"}]


def test_sigterm_ends_an_ingest_as_ctrl_c_does(tmp_path, monkeypatch):
    """What timeout, batch schedulers and Kubernetes send: it killed the run with no message, no
    report and leaked worker semaphores; now the documents in flight finish and the exit code is 143."""
    import os
    import signal

    import kvcodec.ingest
    from kvcodec.cli.main import cli
    from kvcodec.ingest import DocResult

    def terminated(documents, *args, on_result, **kw):  # a real SIGTERM to this process after one document
        on_result(DocResult(documents[0].id, "stored", 10, 1))
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(kvcodec.ingest, "ingest", terminated)
    before = signal.getsignal(signal.SIGTERM)
    (tmp_path / "p.txt").write_text("alpha\nbeta\n")
    args = ["ingest", str(tmp_path / "p.txt"), "--model", "smollm2-135m", "--store", f"file://{tmp_path / 's'}"]
    result = CliRunner().invoke(cli, [*args, "--device", "cpu", "--codec", "raw", "--report", str(tmp_path / "r.json")])
    assert result.exit_code == 143, result.output
    assert "interrupted after 1 stored, 0 skipped, 0 failed of 2 documents" in result.output
    assert json.loads((tmp_path / "r.json").read_text())["interrupted"]
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is the run's only


def test_documents_encoded_at_once_fill_the_cores_with_chunks():
    from kvcodec.ingest.run import documents_at_once

    assert documents_at_once(None, 16, 8) == 2  # 2k-token documents of 8 chunks on 16 cores
    assert documents_at_once(None, 2, 8) == 1 and documents_at_once(None, 16, 1) == 16
    assert documents_at_once(None, 16, 0) == 16 and documents_at_once(3, 16, 8) == 3


def test_ingest_splits_its_encode_threads_by_the_documents_chunks(tmp_path):
    from kvcodec.ingest.run import _encode_pool

    url = f"file://{tmp_path / 'store'}"
    cache = PrefixCache(open_store(url), "m", make_codec("hevc"), "cpu")
    for chunks, want in ((4, (4, 4)), (8, (2, 8)), (None, (2, 8)), (2, (8, 2))):
        pool = _encode_pool(cache, url, "processes", 16, None, chunks)  # no process starts before a store
        try:
            assert (pool.processes, pool.spec.threads) == want
        finally:
            pool.shutdown()
    assert _encode_pool(cache, url, "threads", 16, None, 4) is None


class FlakyStore:
    """A real store whose batched queries (exists_many, get_many) fail (StoreError, as a store that is
    down raises) for the first `failures` calls: the fault is counted, not timed."""

    def __init__(self, inner, failures: int) -> None:  # noqa: ANN001
        self.inner, self.failures, self.url = inner, failures, "flaky+" + inner.url

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)

    def _down(self) -> None:
        from kvcodec.errors import StoreError

        if self.failures > 0:
            self.failures -= 1
            raise StoreError(f"{self.url}: connection refused (down for {self.failures + 1} more calls)")

    def exists_many(self, keys):  # noqa: ANN001, ANN201
        self._down()
        return self.inner.exists_many(keys)

    def get_many(self, keys):  # noqa: ANN001, ANN201
        self._down()
        return self.inner.get_many(keys)


def test_a_store_that_stops_answering_is_waited_for_then_the_job_goes_on_or_stops(smollm2, tmp_path):
    """A store outage failed every remaining document within milliseconds; now the job waits for the
    store (the document is read again once it answers) and stops after its patience (resumable)."""
    from kvcodec.ingest.run import StoreDownError
    from kvcodec.ingest.sources import Document

    model, tokenizer = smollm2
    docs = [Document(f"d{i}", f"Document {i}: " + DOCS[i % 2]) for i in range(3)]
    raw = make_codec("raw", chunk_tokens=32)
    store = FlakyStore(open_store(f"file://{tmp_path / 'a'}"), failures=3)  # the first lookup and two probes
    cache = PrefixCache(store, model_id(model), raw, "cpu")
    s = ingest(docs, model, tokenizer, cache, encode_in="threads").to_dict()
    assert (s["stored"], s["failed"]) == (3, 0) and store.failures == 0
    down = FlakyStore(open_store(f"file://{tmp_path / 'b'}"), failures=10**6)
    seen = []
    with pytest.raises(StoreDownError, match="resume"):
        ingest(
            docs,
            model,
            tokenizer,
            PrefixCache(down, model_id(model), raw, "cpu"),
            store_patience_s=0,
            encode_in="threads",
            on_result=seen.append,
        )
    assert [(r.id, r.status) for r in seen] == [("d0", "failed")]  # the others were not started


def test_a_repeated_document_is_skipped_and_one_longer_than_the_context_fails_unless_cut(smollm2, tmp_path):
    from kvcodec.ingest.sources import Document

    model, tokenizer = smollm2
    long = Document("long", "word " * 9000)  # past SmolLM2's 8192-token context
    docs = [Document("a", DOCS[0]), Document("again", DOCS[0]), long]
    cache = PrefixCache(open_store(f"file://{tmp_path}"), model_id(model), make_codec("raw", chunk_tokens=32), "cpu")
    r = ingest(docs, model, tokenizer, cache, encode_in="threads")
    got = {d.id: d for d in r.results}
    assert got["a"].status == "stored" and got["again"].status == "skipped" and "as a" in got["again"].error
    assert (
        got["long"].status == "failed" and "context holds" in got["long"].error and "--max-tokens" in got["long"].error
    )
    assert r.to_dict()["stored_tokens"] == got["a"].tokens
    cut = ingest([long], model, tokenizer, cache, max_tokens=64, encode_in="threads").results[0]
    assert (cut.status, cut.tokens) == ("stored", 64)


class RefusingPuts:
    """A real store whose writes fail (StoreError, as a store that refuses writes raises)."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.url = inner, "refusing+" + inner.url

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)

    def put_many(self, items):  # noqa: ANN001, ANN201
        from kvcodec.errors import StoreError

        raise StoreError(f"{self.url}: read-only")

    put = put_many


def test_a_repeat_of_a_document_whose_store_fails_fails_with_it(smollm2, tmp_path):
    from kvcodec.ingest.sources import Document

    model, tokenizer = smollm2
    store = RefusingPuts(open_store(f"file://{tmp_path}"))
    cache = PrefixCache(store, model_id(model), make_codec("raw", chunk_tokens=32), "cpu")
    docs = [Document("a", DOCS[0]), Document("again", DOCS[0])]
    got = {r.id: r for r in ingest(docs, model, tokenizer, cache, encode_in="threads", store_patience_s=0.01).results}
    assert got["a"].status == "failed" and "read-only" in got["a"].error
    assert got["again"].status == "failed" and "same tokens as a, whose store failed" in got["again"].error


class DownOnceWritten:
    """A real store that goes down (StoreError on every call) at the first write, which waits for
    `gate`: the fault lands at a fixed point of the job, not at a time."""

    def __init__(self, inner, gate) -> None:  # noqa: ANN001
        self.inner, self.gate, self.down, self.url = inner, gate, False, "down+" + inner.url

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)

    def _refuse(self) -> None:
        from kvcodec.errors import StoreError

        raise StoreError(f"{self.url}: connection refused")

    def exists_many(self, keys):  # noqa: ANN001, ANN201
        if self.down:
            self._refuse()
        return self.inner.exists_many(keys)

    def put_many(self, items):  # noqa: ANN001, ANN201
        self.gate.wait(60)
        self.down = True
        self._refuse()

    put = put_many


def test_a_store_that_goes_down_while_the_last_documents_finish_still_reports_them(smollm2, tmp_path):
    import threading

    from kvcodec.ingest.run import StoreDownError
    from kvcodec.ingest.sources import Document

    model, tokenizer = smollm2
    read_all = threading.Event()

    def documents():  # every lookup is done before any write: the store goes down in the final drain
        yield from (Document(f"d{i}", f"Document {i}: " + DOCS[i % 2]) for i in range(3))
        read_all.set()

    cache = PrefixCache(
        DownOnceWritten(open_store(f"file://{tmp_path}"), read_all),
        model_id(model),
        make_codec("raw", chunk_tokens=32),
        "cpu",
    )
    seen = []
    with pytest.raises(StoreDownError):
        ingest(
            documents(),
            model,
            tokenizer,
            cache,
            encode_in="threads",
            store_workers=3,
            store_patience_s=0,
            on_result=seen.append,
        )
    assert sorted((r.id, r.status) for r in seen) == [("d0", "failed"), ("d1", "failed"), ("d2", "failed")]


def test_a_document_shorter_than_a_chunk_fails_where_partial_chunks_are_not_stored(smollm2, tmp_path):
    from kvcodec.ingest.sources import Document

    model, tokenizer = smollm2
    cache = PrefixCache(
        open_store(f"file://{tmp_path}"),
        model_id(model),
        make_codec("raw", chunk_tokens=32),
        "cpu",
        store_partial=False,
    )
    s = ingest([Document("short", "A few words.")], model, tokenizer, cache, encode_in="threads").to_dict()
    assert (s["stored"], s["skipped"], s["failed"]) == (0, 0, 1) and "fewer than a chunk" in s["errors"][0]["error"]


def test_results_come_in_document_order_when_one_fails_behind_stores_in_flight(smollm2, tmp_path):
    from kvcodec.ingest.sources import Document

    model, tokenizer = smollm2
    cache = PrefixCache(open_store(f"file://{tmp_path}"), model_id(model), make_codec("hevc", chunk_tokens=32), "cpu")
    docs = [Document("a", DOCS[0]), Document("b", DOCS[1]), Document("empty", "")]
    seen = []
    s = ingest(docs, model, tokenizer, cache, on_result=seen.append).to_dict()
    assert [r.id for r in seen] == ["a", "b", "empty"] and (s["stored"], s["failed"]) == (2, 1)


class PutFailsOnce:
    """A real store whose first write fails as a store that is down fails it (StoreError); it answers after."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.failed, self.url = inner, False, "putfails+" + inner.url

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)

    def _write(self, name: str, *args):  # noqa: ANN002, ANN202
        from kvcodec.errors import StoreError

        if not self.failed:
            self.failed = True
            raise StoreError(f"{self.url}: connection reset")
        return getattr(self.inner, name)(*args)

    def put(self, key, value):  # noqa: ANN001, ANN201
        return self._write("put", key, value)

    def put_many(self, items):  # noqa: ANN001, ANN201
        return self._write("put_many", items)


def test_a_document_whose_store_fails_while_the_store_is_down_is_stored_once_it_answers(smollm2, tmp_path):
    from kvcodec.ingest.sources import Document

    model, tokenizer = smollm2
    store = PutFailsOnce(open_store(f"file://{tmp_path}"))
    cache = PrefixCache(store, model_id(model), make_codec("raw", chunk_tokens=32), "cpu")
    docs = [Document(f"d{i}", f"Document {i}: " + DOCS[i % 2]) for i in range(3)]
    s = ingest(docs, model, tokenizer, cache, encode_in="threads").to_dict()
    assert store.failed and (s["stored"], s["failed"]) == (3, 0), s
    for d in docs:
        ids = Tokens(tokenizer).encode(d.text)
        assert cache.lookup(ids, whole=True) == len(ids)


def test_a_repeat_of_a_document_stored_again_after_an_outage_is_not_failed(smollm2, tmp_path):
    from kvcodec.ingest.sources import Document

    model, tokenizer = smollm2
    store = PutFailsOnce(open_store(f"file://{tmp_path}"))
    cache = PrefixCache(store, model_id(model), make_codec("raw", chunk_tokens=32), "cpu")
    docs = [Document("a", DOCS[0]), Document("a-again", DOCS[0])]
    seen = []
    s = ingest(docs, model, tokenizer, cache, encode_in="threads", on_result=seen.append).to_dict()
    assert store.failed and [(r.id, r.status) for r in seen] == [("a", "stored"), ("a-again", "skipped")], seen
    assert s["failed"] == 0


def test_the_ray_driver_reports_results_in_document_order_and_what_it_holds_when_it_stops():
    """The Ray job's results come as its documents finish; the driver reports each once every document
    before it is (as the one-machine job does), and when the job stops, what it holds, in order."""
    from kvcodec.ingest.distributed import _RayRun
    from kvcodec.ingest.run import FAILED, STORED, DocResult

    seen = []
    run = _RayRun(ray=None, job=None, encode=None, on_result=seen.append, store_patience_s=0.0)
    r = [DocResult(f"d{i}", STORED if i % 2 else FAILED) for i in range(6)]
    for i in (2, 1):
        run._done(i, r[i])
    assert seen == []  # d0 has not finished
    run._done(0, r[0])
    assert seen == r[:3]
    run._done(5, r[5])
    run._done(4, r[4])
    assert seen == r[:3]  # d3 has not finished
    run._report_held()  # the job stops: d3 never finishes
    assert seen == [r[0], r[1], r[2], r[4], r[5]] and run.results == seen


def test_a_second_interrupt_in_the_ray_drain_still_reports_the_finished_documents():
    """The job is interrupted while d0's store is in flight and d1 is stored (held behind d0); a second
    interrupt comes while the drain waits for d0: d1 is reported all the same (a Ray stand-in: the
    interrupts cannot be timed into a real cluster's waits)."""
    from kvcodec.ingest.distributed import _InStore, _RayRun
    from kvcodec.ingest.run import STORED, DocResult

    class Ref:
        def __init__(self, value):
            self.value = value

    class Ray:
        class exceptions:
            RayTaskError = RuntimeError

        def __init__(self):
            self.waits = 0

        def get(self, ref):
            return ref.value

        def wait(self, refs, num_returns):
            self.waits += 1
            if self.waits == 1:
                return [r for r in refs if r.value == (5, 0.1)], refs  # d1's store: d0's is still running
            raise KeyboardInterrupt  # the job's interrupt, then a second one in the drain

    ray, seen = Ray(), []
    run = _RayRun(ray=ray, job=None, encode=None, on_result=seen.append, store_patience_s=0.0)
    run.stores = {
        Ref((3, 0.1)): _InStore(0, DocResult("d0", STORED), b"0", "m", [1], None),
        Ref((5, 0.1)): _InStore(1, DocResult("d1", STORED), b"1", "m", [2], None),
    }
    run.storing = {b"0": ("d0", None), b"1": ("d1", None)}
    with pytest.raises(KeyboardInterrupt):
        run.run([], [])
    assert [(r.id, r.chunks) for r in seen] == [("d1", 5)]


class _RayAfterAnOutage:
    """A Ray stand-in for the driver's stores: each encode task's outcome in turn (a StoreError the
    store raised, or (chunks, seconds)); the store answers the driver's probe at once. An outage of a
    real cluster's shared store cannot be timed between a task's failure and its retry."""

    class exceptions:
        RayTaskError = RuntimeError

    class Ref:
        def __init__(self, outcome):
            self.outcome = outcome

    class OnSubmit:  # an outcome raised by encode.remote itself
        def __init__(self, error):
            self.error = error

    def __init__(self, outcomes, probe=None, interrupted_waits=0):
        self.outcomes, self.encoded, self.probes = list(outcomes), [], 0
        self.probe, self.interrupted_waits = probe, interrupted_waits  # the probe's error; waits interrupted first

    def get(self, ref):
        if isinstance(ref.outcome, BaseException):
            raise ref.outcome
        return ref.outcome

    def wait(self, refs, num_returns):
        if self.interrupted_waits:
            self.interrupted_waits -= 1
            raise KeyboardInterrupt
        return refs[:1], refs[1:]

    def remote(self, fn):  # the driver's probe of the store: it answers
        ray = self

        class Probe:
            def options(self, **_):
                return self

            def remote(self, *args):
                ray.probes += 1
                return ray.Ref(ray.probe)

        return Probe()

    def encoder(self):
        ray = self

        class Encode:
            def remote(self, *args):
                ray.encoded.append(args)
                outcome = ray.outcomes.pop(0)
                if isinstance(outcome, ray.OnSubmit):
                    raise outcome.error
                return ray.Ref(outcome)

        return Encode()


def _ray_run_storing(ray, *docs):
    from kvcodec.ingest.distributed import RayJob, _InStore, _RayRun
    from kvcodec.ingest.run import STORED, DocResult

    seen = []
    job = RayJob(model="m", store_url="redis://store:6379/0", codec="raw")
    run = _RayRun(ray=ray, job=job, encode=ray.encoder(), on_result=seen.append, store_patience_s=0.0)
    for i, doc in enumerate(docs):
        run._store(_InStore(i, DocResult(doc, STORED), doc.encode(), "m", [i], f"kv-{doc}"), doc)
    return run, seen


def test_the_ray_driver_stores_a_document_once_more_after_an_outage():
    """d0's encode task failed while the store was down: once the store answers, the driver stores d0's KV
    (still in the object store) again, without a second prefill; its repeat settles with the retry."""
    from kvcodec.errors import StoreError
    from kvcodec.ingest.run import SKIPPED, DocResult

    ray = _RayAfterAnOutage([StoreError("connection refused"), (3, 0.1), (4, 0.2)])  # d0, d1, d0 again
    run, seen = _ray_run_storing(ray, "d0", "d1")
    run.repeats[next(iter(run.stores))] = [(2, DocResult("d0-again", SKIPPED, error="the same tokens as d0"))]
    run.run([], [])
    assert [(r.id, r.status, r.chunks) for r in seen] == [
        ("d0", "stored", 4),
        ("d1", "stored", 3),
        ("d0-again", "skipped", 0),
    ]
    assert ray.probes == 1 and [a[1:] for a in ray.encoded] == [
        ("m", [0], "kv-d0"),
        ("m", [1], "kv-d1"),
        ("m", [0], "kv-d0"),
    ]
    assert not run.stores and not run.storing


def test_the_ray_driver_stores_a_document_once_more_only_once():
    from kvcodec.errors import StoreError

    ray = _RayAfterAnOutage([StoreError("connection refused"), StoreError("connection reset")])
    run, seen = _ray_run_storing(ray, "d0")
    run.run([], [])
    assert [(r.id, r.status, r.store_down) for r in seen] == [("d0", "failed", True)] and "reset" in seen[0].error
    assert len(ray.encoded) == 2 and ray.probes == 2


@pytest.mark.parametrize("stop", ["the store stays down", "interrupted while the retry is submitted"])
def test_a_ray_job_stopped_at_a_retry_reports_the_document_and_its_repeat(stop):
    from kvcodec.errors import StoreError
    from kvcodec.ingest.run import SKIPPED, DocResult, StoreDownError

    down = StoreDownError("the store did not answer within 0 s")
    if stop == "the store stays down":
        ray, error = _RayAfterAnOutage([StoreError("refused")], probe=down), StoreDownError
    else:
        ray, error = (
            _RayAfterAnOutage([StoreError("refused"), _RayAfterAnOutage.OnSubmit(KeyboardInterrupt())]),
            KeyboardInterrupt,
        )
    run, seen = _ray_run_storing(ray, "d0")
    run.repeats[next(iter(run.stores))] = [(1, DocResult("d0-again", SKIPPED, error="the same tokens as d0"))]
    with pytest.raises(error):
        run.run([], [])
    assert [(r.id, r.status) for r in seen] == [("d0", "failed"), ("d0-again", "failed")]
    assert not run.stores and not run.storing


def test_the_ray_drain_after_an_interrupt_neither_waits_for_the_store_nor_stores_again():
    from kvcodec.errors import StoreError

    ray = _RayAfterAnOutage([StoreError("refused")], interrupted_waits=1)
    run, seen = _ray_run_storing(ray, "d0")
    with pytest.raises(KeyboardInterrupt):
        run.run([], [])
    assert [(r.id, r.status) for r in seen] == [("d0", "failed")] and ray.probes == 0 and len(ray.encoded) == 1


@pytest.mark.parametrize(
    "docs, flags, named",
    [
        ("p.txt", ["--prefill-actors", "2"], "--prefill-actors"),
        ("p.txt", ["--encode-cpus", "8"], "--encode-cpus"),
        ("p.txt", ["--text-field", "body"], "--text-field"),
        ("folder", ["--id-field", "name"], "--id-field"),
        ("p.txt", ["--ray", "auto", "--device", "cpu", "--encode-in", "threads"], "--device, --encode-in"),
    ],
)
def test_ingest_refuses_an_option_its_run_would_ignore(tmp_path, docs, flags, named, monkeypatch):
    """Ray's options without --ray, one-machine options with it, JSON Lines fields for other documents: each was
    accepted and ignored."""
    import kvcodec.ingest
    from kvcodec.cli.main import cli

    def never(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("documents were prefilled")

    monkeypatch.setattr(kvcodec.ingest, "ingest", never)
    (tmp_path / "p.txt").write_text("alpha\nbeta\n")
    (tmp_path / "folder").mkdir()
    args = ["ingest", str(tmp_path / docs), "--model", "smollm2-135m", "--store", f"file://{tmp_path / 's'}"]
    r = CliRunner().invoke(cli, [*args, *flags])
    assert r.exit_code == 2 and named in r.output, r.output
