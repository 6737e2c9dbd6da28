"""Engine on a real model (smollm2-135m): reuse gives the same greedy answer as recomputing."""

from __future__ import annotations

import pathlib
import threading

import pytest

torch = pytest.importorskip("torch")

from kvcodec.config import CodecConfig  # noqa: E402
from kvcodec.engine import Engine, SamplingParams, StorePolicy  # noqa: E402

pytestmark = pytest.mark.slow

CHUNK = 32
DOC = (
    "Alice keeps her bicycle in the blue shed behind the library. Bob keeps his canoe in the red "
    "barn near the river. Carol keeps her telescope in the attic of the old school. Dave parks "
    "his green truck in the garage on Elm Street, next to the bakery. Erin stores her violin in "
    "the music room on the second floor. Frank hides his fishing rods under the porch of the "
    "cabin by the lake, where nobody ever looks. "
)


def make_engine(smol, url: str, **kw) -> Engine:
    model, tok = smol
    kw.setdefault("codec_config", CodecConfig(quant="exact", chunk_tokens=CHUNK, resolutions=((256, 256),)))
    kw.setdefault("resolution_policy", "fixed:0")
    kw.setdefault("fetch_deadline_s", None)  # these tests check reuse itself, whatever its speed
    return Engine(model, tokenizer=tok, store_url=url, device="cpu", **kw)


def prompts(tok) -> list[str]:  # noqa: ANN001
    qs = ["Where does Bob keep his canoe?", "Where does Alice keep her bicycle?"]
    out = [f"{DOC}\nQuestion: {q}\nAnswer:" for q in qs]
    assert all(len(tok(p)["input_ids"]) <= 128 for p in out)
    return out


def test_reuse_equals_recompute_exact(smol, tmp_path: pathlib.Path):
    with make_engine(smol, f"file://{tmp_path}") as eng:
        ps = prompts(smol[1])
        base = eng.generate(ps, max_new_tokens=6, reuse=False, store=False)
        eng.generate(ps[:1], max_new_tokens=1, wait_for_store=True)  # stores the first prompt's KV
        again = eng.generate(ps, max_new_tokens=6)
        for b, a in zip(base, again):
            assert b.matched_tokens == 0 and b.restored_tokens == 0 and b.fetch_s is None
            assert a.matched_tokens >= 2 * CHUNK  # the shared document prefix was found
            assert a.fetch_s is not None and 0 < a.fetch_s <= a.ttft_s
            assert a.restored_tokens >= 2 * CHUNK and a.fetch_error is None
            assert a.prefilled_tokens == len(a.prompt_ids) - a.restored_tokens
            assert a.token_ids == b.token_ids
        m = eng.metrics.render().decode()
        assert "kvcodec_reuse_hits_total 2.0" in m
        assert "kvcodec_fetch_fallbacks_total 0.0" in m


def test_reuse_int8_same_greedy_answer(smol, tmp_path: pathlib.Path):
    cfg = CodecConfig(quant="int8", chunk_tokens=CHUNK, resolutions=((256, 256),))
    with make_engine(smol, "memory://", codec_config=cfg) as eng:
        p = prompts(smol[1])[0]
        base = eng.generate(p, max_new_tokens=6, wait_for_store=True)[0]
        again = eng.generate(p, max_new_tokens=6)[0]
        assert again.restored_tokens >= 2 * CHUNK
        assert again.bytes_fetched > 0
        assert again.token_ids == base.token_ids


def test_fetch_failure_recomputes_same_answer(smol, tmp_path: pathlib.Path):
    with make_engine(smol, f"file://{tmp_path}") as eng:
        p = prompts(smol[1])[0]
        base = eng.generate(p, max_new_tokens=6, wait_for_store=True)[0]
        # corrupt every stored object but the chunk metas: a real fault the fetch must survive
        files = [f for f in tmp_path.rglob("*") if f.is_file()]
        blobs = [f for f in files if "meta" not in f.name]
        assert blobs
        for f in blobs:
            data = bytearray(f.read_bytes())
            for i in range(0, len(data), 7):
                data[i] ^= 0x5A
            f.write_bytes(bytes(data))
        again = eng.generate(p, max_new_tokens=6)[0]
        assert again.matched_tokens > 0
        assert again.fetch_error is not None
        assert again.restored_tokens == 0 and again.prefilled_tokens == len(again.prompt_ids)
        assert again.token_ids == base.token_ids
        assert "kvcodec_fetch_fallbacks_total 1.0" in eng.metrics.render().decode()


def test_store_policy_min_tokens(smol):
    with make_engine(smol, "memory://", store_policy=StorePolicy(min_tokens=10_000)) as eng:
        p = prompts(smol[1])[0]
        eng.generate(p, max_new_tokens=1, wait_for_store=True)
        again = eng.generate(p, max_new_tokens=1)[0]
        assert again.matched_tokens == 0


def test_prompts_that_are_no_text_or_token_ids_are_refused_by_name(smol):
    from kvcodec.errors import ConfigError

    with make_engine(smol, "memory://") as eng:
        for bad in (None, 5, [None]):  # were TypeErrors from len() or iteration
            with pytest.raises(ConfigError, match="text or token ids|text, token ids"):
                eng.generate(bad, max_new_tokens=1)
        assert eng.generate([1, 2, 3], max_new_tokens=1)[0].token_ids  # token ids still work


def test_a_batch_with_one_bad_prompt_queues_none_of_them(smol):
    # the good prompts before the bad one were queued, ran for nobody and took the next caller's steps
    from kvcodec.errors import ConfigError

    with make_engine(smol, "memory://") as eng:
        with pytest.raises(ConfigError, match="empty prompt"):
            eng.generate(["a good prompt", ""], max_new_tokens=2)
        assert not any(eng.scheduler.counts().values())
        for bad, says in (
            (dict(stop=["\n"]), "no sampling option stop"),
            (dict(stop_token_ids=11), "stop_token_ids"),  # was a TypeError inside the step: finish_reason error
            (dict(ignore_eos="no"), "ignore_eos"),  # was taken as True
            (dict(params={"max_new_tokens": 2}), "params must be a SamplingParams"),
        ):
            with pytest.raises(ConfigError, match=says):
                eng.generate("Hi", max_new_tokens=2, **bad)
        for call in (lambda: eng.generate(b"hello", max_new_tokens=1), lambda: eng.submit(b"hello")):
            with pytest.raises(ConfigError, match="bytes"):  # its bytes were taken for token ids
                call()


def test_a_closed_engine_refuses_requests_and_close_ends_every_waiting_one(smol):
    """close() left a thread waiting in generate() (the loop stopped, its request unfinished)
    forever; after close, submit queued requests that never ran and generate worked or raised a
    RuntimeError depending on what the store held."""
    from kvcodec.errors import ConfigError

    eng = make_engine(smol, "memory://")
    eng.start()
    req = eng.submit("Count to a thousand:", SamplingParams(max_new_tokens=2000, ignore_eos=True))
    eng.close()
    assert req.done.wait(60) and req.finish_reason == "abort"
    for call in (lambda: eng.generate("Hi", max_new_tokens=1), lambda: eng.submit("Hi"), eng.start):
        with pytest.raises(ConfigError, match="closed"):
            call()
    eng.close()  # again: nothing to do


def test_an_engine_never_closed_leaves_no_shared_memory_behind(smol, tmp_path):
    """The README's one-liner (no close) warned of a leaked shared_memory object at exit."""
    import subprocess
    import sys

    doc = " ".join(f"Line {i}: the quick brown fox number {i} jumps over the lazy dog." for i in range(40))
    script = tmp_path / "once.py"
    script.write_text(
        "from kvcodec.engine import Engine\n"
        "if __name__ == '__main__':\n"
        f"    Engine('smollm2-135m', store_url='file://{tmp_path / 's'}').generate({doc!r}, max_new_tokens=2)\n"
        "    print('done')\n"
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "done" in run.stdout, run.stderr[-2000:]
    assert "leaked" not in run.stderr, run.stderr[-2000:]


def test_sampling_seeded_and_stops(smol):
    with make_engine(smol, "memory://", reuse=False, store_policy=StorePolicy(enabled=False)) as eng:
        p = "Once upon a time"
        sp = SamplingParams(max_new_tokens=5, temperature=0.8, seed=7)
        a = eng.generate(p, params=sp)[0]
        b = eng.generate(p, params=sp)[0]
        assert a.token_ids == b.token_ids and len(a.token_ids) == 5 and a.finish_reason == "length"
        g = eng.generate(p, max_new_tokens=3)[0]
        stop = g.token_ids[1]
        s = eng.generate(p, params=SamplingParams(max_new_tokens=10, stop_token_ids=(stop,)))[0]
        assert s.token_ids == g.token_ids[:2] and s.finish_reason == "stop"


def test_batched_decode_matches_one_by_one(smol):
    prompts = ["The capital of France is", "One, two, three, four, five,", DOC + "Who keeps a canoe?"]
    outs = {}
    for batched in (True, False):
        with make_engine(
            smol, "memory://", reuse=False, store_policy=StorePolicy(enabled=False), batch_decode=batched
        ) as eng:
            outs[batched] = [o.token_ids for o in eng.generate(prompts, max_new_tokens=6, ignore_eos=True)]
    assert outs[True] == outs[False]
    assert all(len(t) == 6 for t in outs[True])


def test_a_failing_sequence_ends_alone(smol):
    """A request that faults in sampling (a NaN temperature, which the door refuses) is
    placed straight in the scheduler: it alone ends with 'error', its batch neighbours finish."""
    from kvcodec.engine import Request

    with make_engine(smol, "memory://", reuse=False, store_policy=StorePolicy(enabled=False)) as eng:
        ps = ["The capital of France is", "One, two, three,"]
        alone = [o.token_ids for o in eng.generate(ps, max_new_tokens=4, ignore_eos=True)]
        good = [eng.submit(p, SamplingParams(max_new_tokens=4, ignore_eos=True)) for p in ps]
        bad = Request(prompt_ids=eng.encode("Hello there"), params=SamplingParams(temperature=float("nan")))
        bad.generator = torch.Generator().manual_seed(0)
        eng.scheduler.add(bad)
        while not all(r.finished for r in [*good, bad]):
            eng.step()
        assert bad.finish_reason == "error" and bad.error
        assert [r.finish_reason for r in good] == ["length", "length"]
        assert [r.output_ids for r in good] == alone
        with pytest.raises(Exception, match="top_p"):
            eng.submit("Hello", SamplingParams(temperature=1.0, top_p=0.0))


def test_long_prompt_prefills_in_chunks_while_others_decode(smol):
    with make_engine(
        smol, "memory://", reuse=False, store_policy=StorePolicy(enabled=False), prefill_chunk_tokens=16
    ) as eng:
        long_p = DOC * 2 + "Who keeps a canoe?"
        one_shot = make_engine(smol, "memory://", reuse=False, store_policy=StorePolicy(enabled=False))
        with one_shot:
            ref = one_shot.generate(long_p, max_new_tokens=3, ignore_eos=True)[0].token_ids
        short = eng.submit("Count: one, two,", SamplingParams(max_new_tokens=12, ignore_eos=True))
        eng.step()  # short is prefilled and decoding
        long_r = eng.submit(long_p, SamplingParams(max_new_tokens=3, ignore_eos=True))
        while not (short.finished and long_r.finished):
            eng.step()
        assert long_r.prompt_len > 8 * 16
        during = [t for t in short.token_times if long_r.scheduled_time < t < long_r.first_token_time]
        assert len(during) >= 4  # short kept decoding while long was being prefilled
        assert long_r.output_ids == ref


def prefill_pieces(smol, prompt: str, **config):  # noqa: ANN001, ANN201
    """(the token count of each prefill piece, the output) of one request on an engine of `config`."""
    with make_engine(smol, "memory://", reuse=False, store_policy=StorePolicy(enabled=False), **config) as eng:
        pieces, run = [], eng.runner.prefill_chunk

        def counted(req, n):  # noqa: ANN001, ANN202
            pieces.append(min(n, req.prompt_len - req.prefill_pos))
            return run(req, n)

        eng.runner.prefill_chunk = counted
        return pieces, eng.generate(prompt, max_new_tokens=3, ignore_eos=True)[0]


def test_a_lone_prompt_prefills_in_one_forward(smol):
    """With no request decoding, a prompt up to max_prefill_tokens goes through the model in one
    forward (a later piece attends through a dense mask, which costs time: engine-prefill-cpu-*.md);
    a longer one in pieces of max_prefill_tokens, to the same answer."""
    long_p = DOC * 2 + "Who keeps a canoe?"
    runs = {}
    for limit in (None, 40):
        kw = {} if limit is None else {"max_prefill_tokens": limit, "prefill_chunk_tokens": 16}
        pieces, out = prefill_pieces(smol, long_p, **kw)
        runs[limit] = (pieces, out)
    (one, out), (cut, out_cut) = runs[None], runs[40]
    assert one == [len(out.prompt_ids)] and len(out.prompt_ids) > 3 * 40
    assert cut[:-1] == [40] * (len(cut) - 1) and sum(cut) == len(out.prompt_ids)
    assert out_cut.token_ids == out.token_ids


def test_store_queue_is_bounded(smol):
    """Stores past the queue bound are dropped and counted, never queued without limit."""
    with make_engine(smol, "memory://", reuse=False, store_queue=1) as eng:
        gate = threading.Event()
        put = eng.prefix_cache.put
        eng.prefix_cache.put = lambda ids, kv: (gate.wait(30), put(ids, kv))[1]  # a store that hangs
        try:
            ps = [f"{DOC} Variant {i}." for i in range(3)]
            eng.generate(ps, max_new_tokens=1)
            assert eng.storer.dropped == 2 and len(eng.storer._pending) == 1
            assert "kvcodec_stores_dropped_total 2.0" in eng.metrics.render().decode()
        finally:
            gate.set()
        eng.storer.flush()


def test_restored_chunks_land_in_the_cache_without_a_copy(smol):
    """A fetch decodes straight into the engine's target (model dtype, the cache's [H, T, D]
    layout), and the request's cache adopts views of it: no copy between decoder and cache."""
    from kvcodec.engine import Request
    from kvcodec.engine.prefix import RestoreTargets

    with make_engine(smol, "memory://") as eng:
        p = prompts(smol[1])[0]
        base = eng.generate(p, max_new_tokens=4, wait_for_store=True)[0]
        req = Request(prompt_ids=eng.encode(p), params=SamplingParams(max_new_tokens=4))
        req.matched_tokens = eng.prefix_cache.lookup(req.prompt_ids)
        target = RestoreTargets(eng.model, eng.device, eng.runner.dtype)(req)
        res = eng.prefix_cache.fetch(req.prompt_ids, req.matched_tokens, out=target)
        assert res.tokens_restored >= 2 * CHUNK and res.kv.data_ptr() == target.data_ptr()
        req.restored_kv, req.restored_tokens = res.kv, res.tokens_restored
        eng.runner.begin_prefill(req)
        k0 = req.cache.layers[0].keys
        assert k0.data_ptr() == target.data_ptr() and k0.dtype == eng.runner.dtype  # a view, not a copy
        assert torch.equal(k0[0].transpose(0, 1), target[0, 0, : req.restored_tokens])
        again = eng.generate(p, max_new_tokens=4)[0]
        assert again.restored_tokens > 0 and again.token_ids == base.token_ids


class _SlowTokenizer:
    """The real tokenizer behind a fixed delay: TTFT must count it."""

    def __init__(self, tok, delay_s: float) -> None:  # noqa: ANN001
        self.tok, self.delay_s = tok, delay_s

    def __call__(self, *a, **k):  # noqa: ANN002, ANN003, ANN204
        import time

        time.sleep(self.delay_s)
        return self.tok(*a, **k)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.tok, name)


def test_ttft_counts_tokenizing_from_arrival(smol):
    import time

    with make_engine(smol, "memory://", reuse=False, store_policy=StorePolicy(enabled=False)) as eng:
        eng.tokens.tokenizer = _SlowTokenizer(eng.tokens.tokenizer, 0.3)
        out = eng.generate("The capital of France is", max_new_tokens=1)[0]
        assert out.ttft_s >= 0.3
        t0 = time.perf_counter()
        req = eng.submit("The capital of France is", SamplingParams(max_new_tokens=1), arrival_time=t0 - 0.5)
        while not req.finished:
            eng.step()
        assert req.arrival_time == t0 - 0.5 and req.ttft >= 0.8  # a caller's arrival time is kept


def test_engine_start_on_a_paused_store_fails_by_its_deadline(smol, redis_server, monkeypatch):
    import signal

    from kvcodec.engine import prefix
    from kvcodec.errors import StoreError

    monkeypatch.setattr(prefix, "STORE_OPEN_DEADLINE_S", 0.3)
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(StoreError, match="deadline"):
            make_engine(smol, redis_server.url)
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    make_engine(smol, redis_server.url).close()


def test_a_piece_after_the_first_is_bounded_by_its_mask(smol, monkeypatch):
    """A piece after the first attends through a dense [piece, cache] mask: its tokens are bounded
    so the mask stays near MASKED_PIECE_ELEMENTS (never below prefill_chunk_tokens); the first piece,
    which has no such mask, is not; the answer is the one-forward answer."""
    from kvcodec.engine import engine as engine_mod

    assert engine_mod.masked_piece_tokens(131072, 2048) == 8192
    assert engine_mod.masked_piece_tokens(32768, 2048) == 32768
    assert engine_mod.masked_piece_tokens(1 << 40, 16) == 16
    long_p = DOC * 2 + "Who keeps a canoe?"
    runs = {}
    for elements in (None, 6000):
        if elements is not None:
            monkeypatch.setattr(engine_mod, "MASKED_PIECE_ELEMENTS", elements)
        kw = {} if elements is None else {"max_prefill_tokens": 100, "prefill_chunk_tokens": 16}
        pieces, out = prefill_pieces(smol, long_p, **kw)
        runs[elements] = (pieces, out)
    (one, out), (cut, out_cut) = runs[None], runs[6000]
    prompt_len = len(out.prompt_ids)
    assert one == [prompt_len] and prompt_len > 150
    later = max(16, 6000 // prompt_len)
    assert cut[0] == 100 and all(n <= later for n in cut[1:]) and sum(cut) == prompt_len
    assert out_cut.token_ids == out.token_ids


def test_open_engine_keeps_its_startup_objects_out_of_full_collections(smol, tmp_path: pathlib.Path, monkeypatch):
    import gc
    import weakref

    from kvcodec.engine import gcfreeze

    monkeypatch.setattr(gcfreeze, "_holders", 0)  # engines other tests left open are forgotten here
    monkeypatch.setattr(gcfreeze, "_theirs", False)
    gc.unfreeze()
    first = make_engine(smol, f"file://{tmp_path}")
    try:
        assert gcfreeze.holders() == 1
        assert gc.get_freeze_count() > 10_000  # the model's modules and tensors, the runtime's objects
        with make_engine(smol, f"file://{tmp_path}", freeze_gc=False):
            assert gcfreeze.holders() == 1
        second = make_engine(smol, f"file://{tmp_path}")
        gone = weakref.ref(second.storer)
        assert second.generate(prompts(smol[1])[:1], max_new_tokens=2)[0].finish_reason in ("length", "stop")
        second.close()
        second.close()  # a second close releases nothing more
        assert gcfreeze.holders() == 1 and gc.get_freeze_count() == 0  # returned to the collector
        del second
        gc.collect()
        assert gone() is None  # a closed engine is collectable while the first is still open
    finally:
        first.close()
    assert gcfreeze.holders() == 0 and gc.get_freeze_count() == 0


def test_reuse_frees_its_buffers_without_the_collector(smol, tmp_path: pathlib.Path):
    """Requests that reuse a stored prefix leave no tensor or Future in a reference cycle: a restored
    prefix's KV in a cycle lives until the collector's next full pass."""
    from test_fetcher_codecs import cyclic_buffers

    with make_engine(smol, f"file://{tmp_path}", codec_config=CodecConfig(quant="int8", chunk_tokens=CHUNK)) as eng:
        ps = prompts(smol[1])
        eng.generate(ps[:1], max_new_tokens=1, wait_for_store=True)
        first = eng.generate(ps, max_new_tokens=2, wait_for_store=True)  # first use: threads made and kept
        assert all(o.restored_tokens for o in first)

        def requests() -> None:
            for _ in range(2):
                out = eng.generate(ps, max_new_tokens=2, store=False)  # nothing left on the storer's threads
                assert all(o.restored_tokens >= 2 * CHUNK for o in out)

        assert cyclic_buffers(requests) == []


def test_health_allows_a_running_prefill_forward_its_predicted_time(smol, tmp_path: pathlib.Path):
    """A long prompt's one forward is work, not a stall: while it runs /health's limit grows by
    FORWARD_ALLOWANCE times its predicted time; after it, the limit is stall_s again."""
    from kvcodec.engine.engine import FORWARD_ALLOWANCE

    with make_engine(smol, f"file://{tmp_path}", stall_s=1.0) as eng:
        seen = []
        forward = eng.runner.prefill_chunk

        def watched(req, n):  # noqa: ANN001, ANN202
            seen.append((n, eng.prefill_rate.deadline_s(n), eng.health()["limit_s"]))
            return forward(req, n)

        eng.runner.prefill_chunk = watched
        ps = prompts(smol[1])
        eng.generate(ps[:1], max_new_tokens=1, reuse=False, store=False)  # measures the prefill rate
        eng.generate(ps[1:], max_new_tokens=1, reuse=False, store=False)
        n, predicted, limit = seen[-1]
        assert predicted is not None and predicted > 0
        assert limit == pytest.approx(1.0 + FORWARD_ALLOWANCE * predicted)
        assert eng.health()["limit_s"] == 1.0


@pytest.mark.parametrize("failing_layer", [0, 2])
def test_a_batched_decode_that_fails_midway_leaves_no_request_a_position_twice(
    smol, tmp_path: pathlib.Path, failing_layer
):
    """A batched step appends each request's new position layer by layer, request after request: where an
    append fails (at the second request's first or third layer), every layer appended is cut back, so the
    one-by-one decode that follows appends each position once."""
    from kvcodec.engine.sequence import Request, SamplingParams

    with make_engine(smol, f"file://{tmp_path}") as eng:
        reqs = []
        for p in prompts(smol[1]):
            req = Request(prompt_ids=smol[1](p)["input_ids"], params=SamplingParams(max_new_tokens=2))
            eng.runner.begin_prefill(req)
            req.output_ids.append(int(eng.runner.prefill_chunk(req, req.prompt_len).argmax()))
            reqs.append(req)
        lens = [r.cache.get_seq_length() for r in reqs]
        real = reqs[1].cache.update

        def failing(k, v, layer, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            if layer >= failing_layer:
                raise RuntimeError("injected: the append of the second request fails")
            return real(k, v, layer, *a, **kw)

        reqs[1].cache.update = failing
        with pytest.raises(RuntimeError, match="injected"):
            eng.runner.decode_batched(reqs)
        reqs[1].cache.update = real
        assert [r.cache.get_seq_length() for r in reqs] == lens
        assert all(layer.get_seq_length() == n for r, n in zip(reqs, lens) for layer in r.cache.layers)
        assert [len(eng.runner.decode([r])) for r in reqs] == [1, 1]
        assert [r.cache.get_seq_length() for r in reqs] == [n + 1 for n in lens]
