"""The kvcodec connector inside the real vLLM package: loaded by vLLM's KVConnectorFactory from
`kv_connector_module_path`, driven with vLLM's own Request, NewRequestData, SchedulerOutput,
KVCacheBlocks and ForwardContext the way its scheduler and worker call a connector, restoring into
per-layer paged caches of vLLM's shape ([blocks, kv_heads, block_size, 2 * head_dim]), with real
model KV over a real file store and a real Redis.

Untested here: a running vLLM engine (vLLM's CPU platform and attention kernels are not installable
next to this venv's CPU torch); so the paged caches are filled and read by this test, and the
connector's scheduler and worker halves run in one process.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base", reason="vllm not installed")

from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.forward_context import ForwardContext  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvcodec.codecs import make_codec  # noqa: E402
from kvcodec.fetcher.keys import chunk_keys  # noqa: E402
from kvcodec.integrations.vllm_connector import KVCodecConnector, layer_order, paged_view  # noqa: E402
from kvcodec.store import open_store  # noqa: E402

BLOCK = 16
CHUNK = 32
NUM_BLOCKS = 24


@pytest.fixture(scope="module")
def prompt_kv(smollm2, short_text):
    """(prompt token ids, canonical KV of the prompt) from a real forward pass."""
    from kvcodec.integrations.hf import extract_kv

    model, tok = smollm2
    ids, kv = extract_kv(model, tok, short_text, max_tokens=100)
    return ids.tolist(), kv


def connectors(url: str, **extra):
    kt = KVTransferConfig(
        kv_connector="KVCodecConnector",
        kv_connector_module_path="kvcodec.integrations.vllm_connector",
        kv_role="kv_both",
        kv_connector_extra_config={"url": url, "chunk_tokens": CHUNK, "model_id": "smollm2-135m", **extra},
    )
    config = VllmConfig(
        kv_transfer_config=kt, cache_config=CacheConfig(block_size=BLOCK), device_config=DeviceConfig(device="cpu")
    )
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[])
    sched = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
    return sched, worker


def paged_caches(kv: torch.Tensor, dtype, shared: bool = True) -> dict[str, torch.Tensor]:
    """Per-layer caches of vLLM's shape; `shared`: views of one allocation, evenly spaced by layer,
    as vLLM 0.33 allocates them (else one tensor per layer)."""
    layers, _, _, heads, dim = kv.shape
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    if shared:
        backing = torch.zeros(layers, NUM_BLOCKS, heads, BLOCK, 2 * dim, dtype=dtype)
        return {name: backing[i] for i, name in enumerate(names)}
    return {name: torch.zeros(NUM_BLOCKS, heads, BLOCK, 2 * dim, dtype=dtype) for name in names}


def write_prompt(caches: dict[str, torch.Tensor], kv: torch.Tensor, block_ids: list[int]) -> None:
    """What vLLM's attention layers do during prefill: each token's K and V into its slot."""
    d = kv.shape[-1]
    for layer, name in enumerate(layer_order(caches)):
        for t in range(kv.shape[2]):
            b, o = block_ids[t // BLOCK], t % BLOCK
            caches[name][b, :, o, :d] = kv[layer, 0, t]
            caches[name][b, :, o, d:] = kv[layer, 1, t]


def read_tokens(caches: dict[str, torch.Tensor], block_ids: list[int], n: int, d: int) -> torch.Tensor:
    out = []
    for name in layer_order(caches):
        c = caches[name]
        toks = [c[block_ids[t // BLOCK], :, t % BLOCK] for t in range(n)]
        x = torch.stack(toks)  # (n, heads, 2d)
        out.append(torch.stack([x[..., :d], x[..., d:]]))
    return torch.stack(out)


def scheduler_step(sched, worker, request: Request, block_ids: list[int], num_scheduled: int, deferred=False):
    """One engine step for a new request: scheduler builds metadata, the worker loads, forwards, saves.
    `deferred`: vLLM's order with speculative decoding, the load errors taken before wait_for_save
    (returned then)."""
    new = NewRequestData.from_request(request, (block_ids,))
    out = SchedulerOutput(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={request.request_id: num_scheduled},
        total_num_scheduled_tokens=num_scheduled,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )
    meta = sched.build_connector_meta(out)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}))
    errors = worker.get_block_ids_with_load_errors() if deferred else None
    worker.wait_for_save()
    worker.clear_connector_metadata()
    worker.wait_for_pending_saves()
    return errors


def admit(sched, request: Request, local_hit: int, block_ids: list[int]) -> int:
    """The scheduler's admission of a waiting request: connector lookup, allocation, bookkeeping."""
    external, is_async = sched.get_num_new_matched_tokens(request, local_hit)
    assert is_async is False
    blocks = KVCacheBlocks(blocks=([KVCacheBlock(block_id=b) for b in block_ids],))
    sched.update_state_after_alloc(request, blocks, external)
    request.num_computed_tokens = local_hit + external
    return external


def first_request_then_second(url, prompt, kv, dtype, local_hit=0, shared=True, **extra):
    sched, worker = connectors(url, **extra)
    assert isinstance(worker, KVCodecConnector)
    caches = paged_caches(kv, dtype, shared)
    worker.register_kv_caches(caches)
    blocks1 = list(range(0, 7))
    r1 = Request("r1", prompt, SamplingParams(max_tokens=1), None)
    assert admit(sched, r1, 0, blocks1) == 0  # nothing stored yet
    write_prompt(caches, kv.to(dtype), blocks1)
    scheduler_step(sched, worker, r1, blocks1, len(prompt))
    r2 = Request("r2", prompt, SamplingParams(max_tokens=1), None)
    blocks2 = list(range(10, 17))
    external = admit(sched, r2, local_hit, blocks2)
    scheduler_step(sched, worker, r2, blocks2, len(prompt) - r2.num_computed_tokens)
    return external, caches, blocks1, blocks2, worker


def test_exact_prefix_stored_by_one_request_restored_for_the_next(prompt_kv, store_url):
    prompt, kv = prompt_kv
    external, caches, blocks1, blocks2, worker = first_request_then_second(
        store_url, prompt, kv, torch.bfloat16, quant="exact"
    )
    n = (len(prompt) - 1) // CHUNK * CHUNK
    assert external == n == 96
    d = kv.shape[-1]
    got = read_tokens(caches, blocks2, n, d)
    want = read_tokens(caches, blocks1, n, d)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    with open_store(store_url) as st:
        codec = make_codec("hevc", quant="exact", chunk_tokens=CHUNK, resolutions=((256, 256),))
        keys = chunk_keys(prompt[:n], "smollm2-135m", codec, partial=False)
        assert all(st.exists_many([worker.object_key(k) for k in keys]))


@pytest.mark.parametrize("shared", [True, False], ids=["paged-restore", "per-layer-scatter"])
def test_int8_restores_kvcodecs_own_decode_and_skips_tokens_vllm_has(prompt_kv, tmp_path, shared):
    prompt, kv = prompt_kv
    url = f"file://{tmp_path}"
    external, caches, blocks1, blocks2, worker = first_request_then_second(
        url, prompt, kv, torch.float16, local_hit=BLOCK, shared=shared, quant="int8"
    )
    assert (worker._pages is not None) == shared
    assert external == 96 - BLOCK
    d = kv.shape[-1]
    codec = make_codec("hevc", quant="int8", chunk_tokens=CHUNK, resolutions=((256, 256),))
    original = read_tokens(caches, blocks1, 96, d)
    want = torch.cat(
        [
            codec.decode_chunk(c.blobs[0], torch.empty_like(original[:, :, :CHUNK]))
            for c in codec.encode_chunks(original)
        ],
        dim=2,
    )
    got = read_tokens(caches, blocks2, 96, d)
    assert torch.equal(got[:, :, BLOCK:], want[:, :, BLOCK:])
    assert not got[:, :, :BLOCK].any()  # the tokens vLLM already held (its own prefix hit) are not written


def store_first_request(sched, worker, prompt, kv) -> None:
    """Request r1's prompt prefilled into blocks 0-6 of new float16 caches and stored by the connector."""
    caches = paged_caches(kv, torch.float16)
    worker.register_kv_caches(caches)
    r1 = Request("r1", prompt, SamplingParams(max_tokens=1), None)
    admit(sched, r1, 0, list(range(7)))
    write_prompt(caches, kv.to(torch.float16), list(range(7)))
    scheduler_step(sched, worker, r1, list(range(7)), len(prompt))


def assert_a_second_requests_blocks_are_load_errors(sched, worker, prompt) -> None:
    """Request r2 of the same prompt is offered its 96 stored tokens, and every block it loads fails."""
    r2 = Request("r2", prompt, SamplingParams(max_tokens=1), None)
    blocks2 = list(range(10, 17))
    assert admit(sched, r2, 0, blocks2) == 96
    scheduler_step(sched, worker, r2, blocks2, len(prompt) - 96)
    assert worker.get_block_ids_with_load_errors() == set(blocks2)


def test_damaged_chunk_reports_its_blocks_as_load_errors(prompt_kv, tmp_path):
    prompt, kv = prompt_kv
    url = f"file://{tmp_path}"
    sched, worker = connectors(url, quant="int8")
    store_first_request(sched, worker, prompt, kv)
    with open_store(url) as st:
        codec = make_codec("hevc", quant="int8", chunk_tokens=CHUNK, resolutions=((256, 256),))
        key = worker.object_key(chunk_keys(prompt[:96], "smollm2-135m", codec, partial=False)[1])
        blob = bytearray(st.get(key))
        blob[len(blob) // 2] ^= 0x21
        st.put(key, bytes(blob))
    assert_a_second_requests_blocks_are_load_errors(sched, worker, prompt)
    r3 = Request("r3", prompt, SamplingParams(max_tokens=1), None)
    assert admit(sched, r3, 0, list(range(20, 27))) == CHUNK  # the damaged chunk 1 was deleted; chunk 0 is kept


def partial_hit(prompt, kv, url: str, damage_chunk: int | None = None, deferred: bool = False, ranks: int = 1):
    """r1 stores the first two chunks of `prompt` (70 of its tokens); r2, the whole prompt, is
    offered those 64 tokens and computes the rest (written here, its loaded blocks zeroed first);
    `deferred`: r2's step in speculative decoding's order; `ranks`: a TP deployment of that many
    ranks (the others' objects stored by hand). Returns (connectors, r2's caches and blocks, the
    store's codec, r2's load errors)."""
    sched, worker = connectors(url, quant="exact")
    sched.shards = worker.shards = (ranks, 1)
    caches = paged_caches(kv, torch.bfloat16)
    worker.register_kv_caches(caches)
    r1 = Request("r1", prompt[:70], SamplingParams(max_tokens=1), None)
    assert admit(sched, r1, 0, list(range(5))) == 0
    write_prompt(caches, kv[:, :, :70].to(torch.bfloat16), list(range(5)))
    scheduler_step(sched, worker, r1, list(range(5)), 70)
    for rank in range(1, ranks):
        worker.rank = (rank, 0)
        worker._store_prefix(prompt[:64], kv[:, :, :64].to(torch.bfloat16))
    worker.rank = (0, 0)
    codec = make_codec("hevc", quant="exact", chunk_tokens=CHUNK, resolutions=((256, 256),))
    if damage_chunk is not None:
        with open_store(url) as st:
            key = worker.object_key(chunk_keys(prompt[:96], "smollm2-135m", codec, partial=False)[damage_chunk])
            blob = bytearray(st.get(key))
            blob[len(blob) // 2] ^= 0x21
            st.put(key, bytes(blob))
    r2, blocks2 = Request("r2", prompt, SamplingParams(max_tokens=1), None), list(range(10, 17))
    assert admit(sched, r2, 0, blocks2) == 2 * CHUNK
    write_prompt(caches, kv.to(torch.bfloat16), blocks2)  # vLLM's forward: the tokens past the hit
    for name in caches:
        caches[name][blocks2[: 2 * CHUNK // BLOCK]] = 0  # the hit's blocks hold nothing until the load
    errors = scheduler_step(sched, worker, r2, blocks2, len(prompt) - 2 * CHUNK, deferred)
    errors = worker.get_block_ids_with_load_errors() if not deferred else errors
    return sched, worker, caches, blocks2, codec, errors


def chunk_stored(url: str, worker, prompt, codec, index: int, rank=(0, 0)) -> bool:
    with open_store(url) as st:
        return st.exists(worker.object_key(chunk_keys(prompt[:96], "smollm2-135m", codec, partial=False)[index], rank))


def test_a_partial_hit_stores_the_chunks_past_the_stored_ones(prompt_kv, tmp_path):
    prompt, kv = prompt_kv
    sched, worker, caches, blocks2, _, errors = partial_hit(prompt, kv, f"file://{tmp_path}")
    assert not errors
    r3, blocks3 = Request("r3", prompt, SamplingParams(max_tokens=1), None), list(range(17, 24))
    assert admit(sched, r3, 0, blocks3) == 96  # chunk 2 was stored by r2 after its hit on chunks 0-1
    scheduler_step(sched, worker, r3, blocks3, len(prompt) - 96)
    d = kv.shape[-1]
    want = kv[:, :, :96].to(torch.bfloat16).view(torch.int16)
    assert torch.equal(read_tokens(caches, blocks3, 96, d).view(torch.int16), want)
    assert torch.equal(read_tokens(caches, blocks2, 96, d).view(torch.int16), want)  # r2's load restored 0-63


@pytest.mark.parametrize("deferred", [False, True], ids=["plain-order", "speculative-decoding-order"])
def test_a_partial_hit_whose_load_failed_stores_nothing_computed_over_it(prompt_kv, tmp_path, deferred):
    prompt, kv = prompt_kv
    url = f"file://{tmp_path}"
    _, worker, _, blocks2, codec, errors = partial_hit(prompt, kv, url, damage_chunk=1, deferred=deferred)
    assert errors == set(blocks2)
    assert not chunk_stored(url, worker, prompt, codec, 2)  # its KV attended to blocks vLLM recomputes


def test_a_save_over_blocks_whose_load_failed_a_few_steps_before_is_skipped(prompt_kv, tmp_path):
    """vLLM learns of a step's failed loads steps later (asynchronous scheduling) and may hand those
    blocks to a later request from its own prefix cache meanwhile: that request's save is skipped."""
    from kvcodec.integrations.vllm_connector import RECENT_LOAD_STEPS, KVCodecConnectorMetadata, PrefixSave

    prompt, kv = prompt_kv
    url = f"file://{tmp_path}"
    _, worker, _, blocks2, codec, errors = partial_hit(prompt, kv, url, damage_chunk=1)
    assert errors == set(blocks2)
    save = PrefixSave("r9", tuple(prompt[:96]), tuple(blocks2), None, 2 * CHUNK)
    forward = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
    for step in range(RECENT_LOAD_STEPS):
        worker.bind_connector_metadata(KVCodecConnectorMetadata(saves=[save] if step == 0 else []))
        worker.start_load_kv(forward)
        worker.wait_for_save()
        worker.clear_connector_metadata()
    worker.wait_for_pending_saves()
    assert not chunk_stored(url, worker, prompt, codec, 2)  # the save right after the failure was skipped
    worker.bind_connector_metadata(KVCodecConnectorMetadata(saves=[save]))  # the failure is out of the window
    worker.start_load_kv(forward)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    worker.wait_for_pending_saves()
    assert chunk_stored(url, worker, prompt, codec, 2)


def step_output(*scheduled: tuple[Request, list[int]]) -> SchedulerOutput:
    """A scheduler step of new requests, each with its blocks, each prefilled whole in the step."""
    n = {r.request_id: len(r.prompt_token_ids) - r.num_computed_tokens for r, _ in scheduled}
    return SchedulerOutput(
        scheduled_new_reqs=[NewRequestData.from_request(r, (blocks,)) for r, blocks in scheduled],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=n,
        total_num_scheduled_tokens=sum(n.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def stored_for_every_rank(sched, url: str, prompt, tokens: int, ranks: int) -> None:
    with open_store(url) as st:
        codec = make_codec("hevc", quant="exact", chunk_tokens=CHUNK, resolutions=((256, 256),))
        for key in chunk_keys(prompt[:tokens], "smollm2-135m", codec, partial=False):
            for r in range(ranks):
                st.put(sched.object_key(key, (r, 0)), b"x")


def test_under_tp_no_save_reads_a_block_another_request_loads_in_the_same_or_a_recent_step(prompt_kv, tmp_path):
    """Request B hits A's blocks in vLLM's own prefix cache while A's load fills them (the same step)
    or before vLLM reports how it went (later steps): one rank cannot see another's failed load, so
    under TP B's save is dropped, on one rank kept; C, on blocks of its own, is saved either way."""
    from kvcodec.integrations.vllm_connector import RECENT_LOAD_STEPS

    prompt, kv = prompt_kv
    other = [t + 1 for t in prompt]  # C's prompt: nothing stored, nothing shared
    for ranks in (1, 2):
        url = f"file://{tmp_path}/{ranks}"
        sched, _ = connectors(url, quant="exact")
        sched.shards = (ranks, 1)
        stored_for_every_rank(sched, url, prompt, 64, ranks)
        a, b, c = (
            Request(n, p, SamplingParams(max_tokens=1), None) for n, p in (("a", prompt), ("b", prompt), ("c", other))
        )
        assert admit(sched, a, 0, list(range(7))) == 64
        assert admit(sched, b, 64, [0, 1, 2, 3, 10, 11, 12]) == 0  # vLLM's own hit on A's first 4 blocks
        assert admit(sched, c, 0, list(range(13, 20))) == 0
        meta = sched.build_connector_meta(
            step_output((a, list(range(7))), (b, [0, 1, 2, 3, 10, 11, 12]), (c, list(range(13, 20))))
        )
        assert [load.req_id for load in meta.loads] == ["a"]
        assert sorted(save.req_id for save in meta.saves) == (["a", "b", "c"] if ranks == 1 else ["c"])
        for step in range(RECENT_LOAD_STEPS):  # D hits A's blocks in each later step
            d = Request(f"d{step}", prompt, SamplingParams(max_tokens=1), None)
            assert admit(sched, d, 64, [0, 1, 2, 3, 20, 21, 22]) == 0
            meta = sched.build_connector_meta(step_output((d, [0, 1, 2, 3, 20, 21, 22])))
            expect = ranks == 1 or step == RECENT_LOAD_STEPS - 1  # A's load is out of the window at the last
            assert [save.req_id for save in meta.saves] == ([d.request_id] if expect else []), (ranks, step)


def test_no_save_reads_a_block_a_rank_reported_failed_until_vllm_reuses_it_for_new_kv(prompt_kv, tmp_path):
    from vllm.v1.outputs import KVConnectorOutput

    prompt, _ = prompt_kv
    url = f"file://{tmp_path}"
    sched, _ = connectors(url, quant="exact")
    sched.update_connector_output(KVConnectorOutput(invalid_block_ids={0, 1, 2, 3}))  # another rank's, say
    b = Request("b", prompt, SamplingParams(max_tokens=1), None)
    assert admit(sched, b, 64, [0, 1, 2, 3, 10, 11, 12]) == 0  # vLLM's own hit on the failed blocks
    assert sched.build_connector_meta(step_output((b, [0, 1, 2, 3, 10, 11, 12]))).saves == []
    c = Request("c", prompt, SamplingParams(max_tokens=1), None)
    assert admit(sched, c, 0, [3, 4, 5, 6, 7, 8, 9]) == 0  # block 3 handed out again for new KV
    assert [save.req_id for save in sched.build_connector_meta(step_output((c, [3, 4, 5, 6, 7, 8, 9]))).saves] == ["c"]
    d = Request("d", prompt, SamplingParams(max_tokens=1), None)
    assert admit(sched, d, 48, [0, 1, 2, 14, 15, 16, 17]) == 0  # blocks 0-2 still hold the failed load
    assert sched.build_connector_meta(step_output((d, [0, 1, 2, 14, 15, 16, 17]))).saves == []
    stored_for_every_rank(sched, url, prompt, 64, 1)  # E is offered 64 stored tokens, loaded into blocks 18-21
    sched.update_connector_output(KVConnectorOutput(invalid_block_ids={18, 19}))
    e = Request("e", prompt, SamplingParams(max_tokens=1), None)
    assert admit(sched, e, 0, list(range(17, 24))) == 64
    meta = sched.build_connector_meta(step_output((e, list(range(17, 24)))))
    assert [load.req_id for load in meta.loads] == ["e"] and [save.req_id for save in meta.saves] == ["e"]


def test_a_partial_hit_under_tensor_parallelism_stores_nothing(prompt_kv, tmp_path):
    """One rank cannot see another's failed load, whose garbage reaches its KV through the
    all-reduce: with several ranks the chunks past a hit are not stored."""
    prompt, kv = prompt_kv
    url = f"file://{tmp_path}"
    _, worker, _, _, codec, errors = partial_hit(prompt, kv, url, ranks=2)
    assert not errors and chunk_stored(url, worker, prompt, codec, 1, (1, 0))
    assert not chunk_stored(url, worker, prompt, codec, 2)


def test_another_ranks_chunk_served_under_this_ranks_key_is_a_load_error_not_its_heads(prompt_kv, tmp_path):
    prompt, kv = prompt_kv
    url = f"file://{tmp_path}"
    sched, worker = connectors(url, quant="exact")
    sched.shards = worker.shards = (2, 1)  # a TP=2 deployment: each rank stores its own heads
    store_first_request(sched, worker, prompt, kv)
    worker.rank = (1, 0)
    worker._store_prefix(prompt[:96], -kv[:, :, :96].to(torch.float16))  # rank 1's objects, other values
    worker.rank = (0, 0)
    with open_store(url) as st:
        codec = make_codec("hevc", quant="exact", chunk_tokens=CHUNK, resolutions=((256, 256),))
        for key in chunk_keys(prompt[:96], "smollm2-135m", codec, partial=False):
            st.put(worker.object_key(key), st.get(worker.object_key(key, (1, 0))))  # served for rank 0's key
    assert_a_second_requests_blocks_are_load_errors(sched, worker, prompt)
    r3 = Request("r3", prompt, SamplingParams(max_tokens=1), None)
    assert admit(sched, r3, 0, list(range(20, 27))) == 0  # the refused object was deleted: a miss, saved again


def test_a_decoder_that_fails_on_sound_streams_keeps_the_object(prompt_kv, tmp_path, monkeypatch):
    # a GPU decoder in a bad state (a CUDA error) cannot be caused here: its CorruptStreamError is raised for it
    from kvcodec.errors import CorruptStreamError

    prompt, kv = prompt_kv
    sched, worker = connectors(f"file://{tmp_path}", quant="int8")
    store_first_request(sched, worker, prompt, kv)

    def failing(blob, out):
        raise CorruptStreamError("cuvidDecodePicture failed (CUDA error 700) (test)")

    monkeypatch.setattr(worker.codec, "decode_chunk", failing)
    assert_a_second_requests_blocks_are_load_errors(sched, worker, prompt)
    r3 = Request("r3", prompt, SamplingParams(max_tokens=1), None)
    assert admit(sched, r3, 0, list(range(20, 27))) == 96  # nothing deleted: the store is sound


def test_a_chunk_one_rank_lost_is_offered_to_no_rank(prompt_kv, tmp_path):
    prompt, kv = prompt_kv
    url = f"file://{tmp_path}"
    sched, worker = connectors(url, quant="exact")
    sched.shards = worker.shards = (2, 1)
    store_first_request(sched, worker, prompt, kv)  # rank 0's objects
    worker.rank = (1, 0)
    worker._store_prefix(prompt[:96], kv[:, :, :96].to(torch.float16))  # rank 1's
    worker.rank = (0, 0)
    r2 = Request("r2", prompt, SamplingParams(max_tokens=1), None)
    assert admit(sched, r2, 0, list(range(10, 17))) == 96
    with open_store(url) as st:
        codec = make_codec("hevc", quant="exact", chunk_tokens=CHUNK, resolutions=((256, 256),))
        st.delete(worker.object_key(chunk_keys(prompt[:96], "smollm2-135m", codec, partial=False)[1], (1, 0)))
    r3 = Request("r3", prompt, SamplingParams(max_tokens=1), None)
    assert admit(sched, r3, 0, list(range(20, 27))) == CHUNK  # chunk 1 is whole on no rank now


def test_each_tp_and_pp_rank_has_its_own_objects(tmp_path):
    _, worker = connectors(f"file://{tmp_path}")
    keys = {worker.object_key("k", (tp, pp)) for tp in range(2) for pp in range(2)}
    assert len(keys) == 4 and worker.object_key("k") == worker.object_key("k", (0, 0))


def test_paged_view_addresses_every_layers_k_and_v():
    kv = torch.zeros(3, 2, 1, 2, 4)
    caches = paged_caches(kv, torch.float32)
    for c in caches.values():
        c.copy_(torch.randn_like(c))
    pages = paged_view(list(caches.values()))
    for layer, c in enumerate(caches.values()):
        assert torch.equal(pages[layer, 0], c[..., :4].permute(0, 2, 1, 3))
        assert torch.equal(pages[layer, 1], c[..., 4:].permute(0, 2, 1, 3))
    assert paged_view(list(paged_caches(kv, torch.float32, shared=False).values())) is None


def test_layer_order_is_numeric():
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 0, 1)]
    assert layer_order(names) == [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 10)]


def _stored_by_r1(url, prompt, kv, **extra):
    """A scheduler and worker whose store holds `prompt`'s chunks (saved by a first request)."""
    sched, worker = connectors(url, quant="exact", **extra)
    caches = paged_caches(kv, torch.float16)
    worker.register_kv_caches(caches)
    r1 = Request("r1", prompt, SamplingParams(max_tokens=1), None)
    assert admit(sched, r1, 0, list(range(7))) == 0
    write_prompt(caches, kv.to(torch.float16), list(range(7)))
    scheduler_step(sched, worker, r1, list(range(7)), len(prompt))
    return sched, worker, caches


def test_a_cache_salt_or_lora_adapter_never_finds_another_ones_prefix(prompt_kv, tmp_path):
    # the keys hashed only the tokens: a request of another tenant (cache_salt) or adapter got r1's KV
    from vllm.lora.request import LoRARequest

    prompt, kv = prompt_kv
    sched, _, _ = _stored_by_r1(f"file://{tmp_path}", prompt, kv)
    same = Request("same", prompt, SamplingParams(max_tokens=1), None)
    salted = Request("salted", prompt, SamplingParams(max_tokens=1), None, cache_salt="tenant-b")
    adapted = Request("lora", prompt, SamplingParams(max_tokens=1), None, lora_request=LoRARequest("ad", 1, "/x"))
    assert [sched.get_num_new_matched_tokens(r, 0)[0] for r in (same, salted, adapted)] == [96, 0, 0]
    # no salt can pose as another salt and adapter (the fields were joined with "|")
    tricky = Request("t", prompt, SamplingParams(max_tokens=1), None, cache_salt='b", ["ad", "/x"]')
    assert sched.request_namespace(tricky)[1] != sched.request_namespace(adapted)[1]
    other_weights = Request("w", prompt, SamplingParams(max_tokens=1), None, lora_request=LoRARequest("ad", 1, "/y"))
    assert sched.request_namespace(other_weights)[1] != sched.request_namespace(adapted)[1]


def test_a_multimodal_prompt_is_neither_offered_nor_stored(prompt_kv, tmp_path):
    # its placeholder tokens are the same for any image: its KV is not named by its tokens
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    prompt, kv = prompt_kv
    sched, _, _ = _stored_by_r1(f"file://{tmp_path}", prompt, kv)
    image = MultiModalFeatureSpec(None, "image", "img-1", PlaceholderRange(offset=2, length=8), "hash-1")
    r = Request("mm", prompt, SamplingParams(max_tokens=1), None, mm_features=[image])
    assert sched.request_namespace(r) == (False, None) and sched.get_num_new_matched_tokens(r, 0)[0] == 0


def test_a_store_that_goes_down_is_a_miss_not_a_dead_scheduler(prompt_kv, redis_server):
    prompt, kv = prompt_kv
    sched, worker, caches = _stored_by_r1(redis_server.url, prompt, kv)
    redis_server.kill()
    r2 = Request("r2", prompt, SamplingParams(max_tokens=1), None)
    assert admit(sched, r2, 0, list(range(10, 17))) == 0  # vLLM's scheduler called this with no try: it died
    scheduler_step(sched, worker, r2, list(range(10, 17)), len(prompt))  # no save either, no exception


def test_a_request_resumed_after_preemption_is_restored(prompt_kv, tmp_path):
    # vLLM's v1 runner schedules a resumed request among the cached ones: its offered tokens were
    # counted as computed and never loaded (its blocks stayed zeros)
    prompt, kv = prompt_kv
    sched, worker, caches = _stored_by_r1(f"file://{tmp_path}", prompt, kv)
    r2 = Request("r2", prompt, SamplingParams(max_tokens=1), None)
    blocks2 = list(range(10, 17))
    external = admit(sched, r2, 0, blocks2)
    cached = CachedRequestData.make_empty()
    cached.req_ids, cached.resumed_req_ids = ["r2"], {"r2"}
    cached.new_block_ids, cached.num_computed_tokens = [(blocks2,)], [r2.num_computed_tokens]
    out = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={"r2": len(prompt) - external},
        total_num_scheduled_tokens=len(prompt) - external,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )
    worker.bind_connector_metadata(sched.build_connector_meta(out))
    worker.start_load_kv(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}))
    d = kv.shape[-1]
    assert external == 96 and not worker.get_block_ids_with_load_errors()
    assert torch.equal(read_tokens(caches, blocks2, 96, d), read_tokens(caches, list(range(7)), 96, d))


@pytest.mark.parametrize("shared", [True, False], ids=["paged-restore", "per-layer-scatter"])
def test_caches_of_kernel_blocks_smaller_than_vllms_blocks(prompt_kv, tmp_path, shared):
    # vLLM may split each scheduler block into kernel blocks ([blocks * k, heads, block_size / k, 2d]):
    # the connector indexed them by scheduler blocks (IndexError in the worker)
    prompt, kv = prompt_kv
    kernel, per = BLOCK // 2, 2
    layers, _, _, heads, d = kv.shape
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]

    def caches():
        if shared:
            backing = torch.zeros(layers, NUM_BLOCKS * per, heads, kernel, 2 * d, dtype=torch.float16)
            return {n: backing[i] for i, n in enumerate(names)}
        return {n: torch.zeros(NUM_BLOCKS * per, heads, kernel, 2 * d, dtype=torch.float16) for n in names}

    def slot(block_ids, t):
        return block_ids[t // BLOCK] * per + (t % BLOCK) // kernel, t % kernel

    sched, worker = connectors(f"file://{tmp_path}", quant="exact")
    c1 = caches()
    worker.register_kv_caches(c1)
    for layer, n in enumerate(names):
        for t in range(len(prompt)):
            b, o = slot(list(range(7)), t)
            c1[n][b, :, o] = torch.cat([kv[layer, 0, t], kv[layer, 1, t]], -1).to(torch.float16)
    r1 = Request("r1", prompt, SamplingParams(max_tokens=1), None)
    admit(sched, r1, 0, list(range(7)))
    scheduler_step(sched, worker, r1, list(range(7)), len(prompt))
    c2 = caches()
    worker.register_kv_caches(c2)
    r2 = Request("r2", prompt, SamplingParams(max_tokens=1), None)
    blocks2 = list(range(10, 17))
    assert admit(sched, r2, 0, blocks2) == 96
    scheduler_step(sched, worker, r2, blocks2, len(prompt) - 96)
    assert not worker.get_block_ids_with_load_errors()
    for n in names:
        for t in range(96):
            assert torch.equal(
                c2[n][slot(blocks2, t)[0], :, slot(blocks2, t)[1]], c1[n][slot(list(range(7)), t)[0], :, t % kernel]
            )


@pytest.mark.parametrize("shared", [True, False], ids=["paged-restore", "per-layer-scatter"])
def test_a_server_of_another_cache_dtype_restores_the_stored_chunks_cast(prompt_kv, tmp_path, shared):
    # float16 chunks loaded by a bfloat16 server were a load error for every request (vLLM's default
    # policy fails such a request), every time
    prompt, kv = prompt_kv
    url = f"file://{tmp_path}"
    _stored_by_r1(url, prompt, kv)  # float16 caches, exact codec
    sched, worker = connectors(url, quant="exact")
    caches = paged_caches(kv, torch.bfloat16, shared)
    worker.register_kv_caches(caches)
    r2 = Request("r2", prompt, SamplingParams(max_tokens=1), None)
    blocks2 = list(range(10, 17))
    assert admit(sched, r2, 0, blocks2) == 96
    scheduler_step(sched, worker, r2, blocks2, len(prompt) - 96)
    assert worker.get_block_ids_with_load_errors() == set()
    got = read_tokens(caches, blocks2, 96, kv.shape[-1])
    assert torch.equal(got, kv[:, :, :96].to(torch.float16).to(torch.bfloat16))


def test_chunks_beyond_the_servers_float16_range_are_a_load_error_not_inf(prompt_kv, tmp_path):
    prompt, kv = prompt_kv
    url = f"file://{tmp_path}"
    sched, worker = connectors(url, quant="exact")
    worker.register_kv_caches(paged_caches(kv, torch.bfloat16))
    big = kv[:, :, :96].to(torch.bfloat16).clone()
    big[0, 0, 40, 0, 0] = 1e6  # a bfloat16 value float16 cannot hold, in chunk 1
    worker._store_prefix(prompt[:96], big)
    sched2, worker2 = connectors(url, quant="exact")
    caches = paged_caches(kv, torch.float16)
    worker2.register_kv_caches(caches)
    r2 = Request("r2", prompt, SamplingParams(max_tokens=1), None)
    blocks2 = list(range(10, 17))
    assert admit(sched2, r2, 0, blocks2) == 96
    scheduler_step(sched2, worker2, r2, blocks2, len(prompt) - 96)
    assert worker2.get_block_ids_with_load_errors() == set(blocks2)  # the load fails at chunk 1: all its blocks
    got = read_tokens(caches, blocks2, CHUNK, kv.shape[-1])
    assert torch.equal(got, big[:, :, :CHUNK].to(torch.float16))
    assert torch.isfinite(read_tokens(caches, blocks2, 96, kv.shape[-1])).all()
