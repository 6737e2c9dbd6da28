"""Fetch-aware scheduling on a real model and a real slow store (token-bucket throttled link)."""

from __future__ import annotations

import pathlib
import urllib.parse

import pytest

torch = pytest.importorskip("torch")

from kvcodec.config import CodecConfig  # noqa: E402
from kvcodec.engine import (  # noqa: E402
    Engine,
    EngineConfig,
    Request,
    SamplingParams,
    Scheduler,  # noqa: E402
    State,
)
from kvcodec.errors import ConfigError  # noqa: E402
from kvcodec.fetcher.rawcodec import RawCodec  # noqa: E402

pytestmark = pytest.mark.slow

CHUNK = 32
LONG = " ".join(f"Item {i} is stored in box {i * 7 % 13}." for i in range(12))  # ~120 tokens


def engine(smol, url: str, **kw) -> Engine:
    model, tok = smol
    return Engine(
        model,
        tokenizer=tok,
        store_url=url,
        device="cpu",
        codec_config=CodecConfig(quant="exact", chunk_tokens=CHUNK, resolutions=((256, 256),)),
        resolution_policy="fixed:0",
        codec=RawCodec(),
        **{"fetch_deadline_s": None, **kw},
    )


def slow_url(tmp_path: pathlib.Path, gbit: float) -> str:
    return f"throttle://{gbit}?inner=" + urllib.parse.quote(f"file://{tmp_path}", safe="")


@pytest.fixture(scope="module")
def stored(smol, tmp_path_factory):
    """A store holding the KV of LONG's tokens; returns (dir, bytes per fetch of LONG)."""
    d = tmp_path_factory.mktemp("kv")
    with engine(smol, f"file://{d}") as eng:
        eng.generate(LONG, max_new_tokens=1, wait_for_store=True)
        out = eng.generate(LONG, max_new_tokens=1, store=False)[0]
    assert out.restored_tokens >= 3 * CHUNK
    return d, out.bytes_fetched


def _race(smol, stored, policy: str) -> tuple[Request, Request]:
    """A reuse request whose fetch takes ~3 s over the link, then a request without reuse."""
    d, nbytes = stored
    gbit = nbytes * 8 / 3.0 / 1e9
    with engine(smol, slow_url(d, gbit), policy=policy) as eng:
        eng.generate("Hello", max_new_tokens=2, store=False)  # warm up the model
        params = SamplingParams(max_new_tokens=3)
        a = eng.submit(LONG, params)
        b = eng.submit("The weather today is", params, reuse=False, store=False)
        while not (a.finished and b.finished):
            if eng.scheduler.wait_for_work(timeout=0.5):
                eng.step()
    assert a.matched_tokens > 0 and b.matched_tokens == 0
    assert a.fetch_end - a.fetch_start > 1.5  # the link really was slow
    return a, b


def test_non_reuse_request_never_waits_for_fetch(smol, stored):
    a, b = _race(smol, stored, "fetch-aware")
    assert b.arrival_time > a.arrival_time  # b came second ...
    assert b.finish_time < a.fetch_end  # ... and was done before a's KV even arrived
    assert a.restored_tokens > 0 and a.fetch_error is None
    assert a.first_token_time > a.fetch_end  # a joined the batch only after its fetch


def test_blocking_policy_makes_others_wait(smol, stored):
    a, b = _race(smol, stored, "blocking")
    assert b.first_token_time > a.fetch_end  # head-of-line blocking behind the fetch
    assert a.restored_tokens > 0


def test_fetch_deadline_falls_back_to_recompute(smol, stored):
    d, nbytes = stored
    with engine(smol, slow_url(d, nbytes * 8 / 6.0 / 1e9), fetch_deadline_s=0.3) as eng:
        ref = eng.generate(LONG, max_new_tokens=3, reuse=False, store=False)[0]
        out = eng.generate(LONG, max_new_tokens=3, store=False)[0]
    assert out.matched_tokens > 0 and out.fetch_error is not None
    assert out.restored_tokens < out.matched_tokens
    assert out.restored_tokens + out.prefilled_tokens == len(out.prompt_ids)
    assert out.token_ids == ref.token_ids


def test_a_request_aborted_while_its_fetch_waits_for_a_worker_is_not_fetched(smol, stored):
    """One fetch worker, busy with a fetch over a slow link: a reuse request aborted meanwhile (its
    client left) was fetched all the same once the worker was free, delaying every fetch behind it."""
    d, nbytes = stored
    with engine(smol, slow_url(d, nbytes * 8 / 3.0 / 1e9), fetch_workers=1) as eng:
        a = eng.submit(LONG, SamplingParams(max_new_tokens=1))
        b = eng.submit(LONG, SamplingParams(max_new_tokens=1))
        eng.abort(b)
        while not (a.finished and b.finished):
            if eng.scheduler.wait_for_work(timeout=0.5):
                eng.step()
    assert a.restored_tokens > 0 and a.fetch_error is None
    assert b.finish_reason == "abort" and b.fetch_error == "aborted before its fetch began" and not b.fetch_stats


def test_a_fetch_deadline_counts_from_arrival_not_from_when_a_worker_is_free(smol, stored):
    """A request that waited in the fetch queue past its deadline is recomputed without a fetch:
    the deadline restarted when a worker took it (fetch_s 1.8 s against a deadline of 0.59 s)."""
    d, _ = stored
    with engine(smol, f"file://{d}", fetch_deadline_s=5.0) as eng:
        req = Request(prompt_ids=eng.encode(LONG), params=SamplingParams(max_new_tokens=1))
        req.matched_tokens = eng.scheduler.prefix_cache.lookup(req.prompt_ids)
        req.fetch_start = req.arrival_time - 6.0  # queued for 6 s
        eng.scheduler._fetch(req)
    assert req.matched_tokens > 0 and req.restored_tokens == 0 and req.restored_kv is None
    assert req.fetch_error == "its deadline passed in its lookup or while it waited for a fetch worker"


def test_running_batch_admits_and_retires_between_steps(smol):
    with engine(smol, "memory://", reuse=False, max_batch=2) as eng:
        reqs = [eng.submit(f"Count to {n}:", SamplingParams(max_new_tokens=n, ignore_eos=True)) for n in (1, 3, 2)]
        sizes = []
        while any(not r.finished for r in reqs):
            eng.step()
            sizes.append(len(eng.scheduler.running))
        assert max(sizes) == 2  # never more than max_batch
        assert [len(r.output_ids) for r in reqs] == [1, 3, 2]
        # the third request joined when the first left, before the second finished
        assert reqs[2].scheduled_time < reqs[1].finish_time
        assert reqs[2].scheduled_time >= reqs[0].finish_time


def test_scheduler_config_errors():
    with pytest.raises(ConfigError):
        Scheduler(None, policy="lifo")
    with pytest.raises(ConfigError):
        Scheduler(None, max_batch=0)
    s = Scheduler(None)
    cfg = EngineConfig()  # a Scheduler made alone schedules as the engine's does
    assert (s.policy, s.max_batch, s.max_prefill_tokens) == (cfg.policy, cfg.max_batch, cfg.max_prefill_tokens)
    r = Request(prompt_ids=[1, 2, 3])
    s.add(r)
    assert r.state is State.WAITING and s.schedule() == [r] and r.state is State.RUNNING


def test_default_deadline_is_the_measured_recompute_time(smol, stored):
    """With the default deadline ("auto"), a fetch over a link that needs 4x that deadline stops
    once it has taken as long as recomputing the prefix would, and the answer is unchanged. The
    link is set from the engine's own measure: a loaded machine prefills slower, and a fixed link
    then finished inside the deadline."""
    from kvbench.net.trace import JitterTrace

    d, nbytes = stored
    with engine(smol, slow_url(d, 1.0), fetch_deadline_s="auto") as eng:
        assert eng.prefill_rate.tokens_per_s is not None  # measured when the engine started
        ref = eng.generate(LONG, max_new_tokens=3, reuse=False, store=False)[0]
        transfer_s = 4 * eng.prefill_rate.deadline_s(len(smol[1](LONG).input_ids))
        eng.scheduler.prefix_cache.store.link.trace = JitterTrace.constant(nbytes * 8 / transfer_s / 1e9)
        req = eng.submit(LONG, SamplingParams(max_new_tokens=3))
        while not req.finished:
            if eng.scheduler.wait_for_work(timeout=0.5):
                eng.step()
    expected = req.matched_tokens / eng.prefill_rate.tokens_per_s
    assert req.fetch_deadline_s is not None and req.fetch_deadline_s > 0
    assert req.fetch_error is not None and req.restored_tokens < req.matched_tokens
    assert req.fetch_s < (req.fetch_deadline_s + transfer_s) / 2  # stopped near its deadline, not after the transfer
    assert expected / 4 < req.fetch_deadline_s < expected * 4
    assert req.output_ids == ref.token_ids


def test_an_aborted_request_stops_its_fetch_where_it_is(smol, stored):
    """A reuse request whose fetch over a slow link (12 s for the prefix) is under way when its
    client leaves: the fetch stops then, not at its end, and the request ends with 'abort'."""
    import time

    d, nbytes = stored
    with engine(smol, slow_url(d, nbytes * 8 / 12.0 / 1e9)) as eng:
        link = eng.scheduler.prefix_cache.store.link
        a = eng.submit(LONG, SamplingParams(max_new_tokens=1))
        for _ in range(6000):  # the fetch has read from the store: it is under way (at most 60 s)
            if link.bytes_total:
                break
            time.sleep(0.01)
        eng.abort(a)
        while not a.finished:
            if eng.scheduler.wait_for_work(timeout=0.5):
                eng.step()
    assert a.matched_tokens > 0 and a.finish_reason == "abort"
    assert "cancelled" in a.fetch_error and a.restored_tokens < a.matched_tokens, a.fetch_error
    assert a.fetch_end - a.fetch_start < 8  # the link alone needs 12 s for the whole prefix
