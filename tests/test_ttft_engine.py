"""`kvcodec bench ttft-engine` on the CPU: relocated chunks decode as the chunk they now are, and
the whole prep -> run path through Engine + PrefixCache on a tiny random-weight model (no timing
asserted: only what was measured, restored and modelled)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from click.testing import CliRunner  # noqa: E402

from kvbench import ttft_engine  # noqa: E402
from kvbench.methods import accuracy_of, method_codec  # noqa: E402
from kvcodec.config import CodecConfig  # noqa: E402
from kvcodec.kvspec.files import save_kv_file  # noqa: E402
from kvcodec.transform import RopeSpec, calibrate, save_kvt  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def real_like_kv(tokens: int, layers: int = 3, heads: int = 2, dim: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    mix = torch.randn(8, layers * 2 * heads * dim, generator=g)
    x = torch.randn(tokens, 8, generator=g) @ mix + 0.1 * torch.randn(tokens, layers * 2 * heads * dim, generator=g)
    return x.view(tokens, layers, 2, heads, dim).permute(1, 2, 0, 3, 4).contiguous().to(torch.float16)


@pytest.mark.parametrize("method", ["raw", "zstd-3"])
def test_relocated_chunk_decodes_as_the_chunk_it_now_is(method):
    codec = method_codec(method, CodecConfig(chunk_tokens=256))
    kv = real_like_kv(256)
    blob = codec.encode_chunks(kv, keys=["seed-0"])[0].blobs[0]
    moved = ttft_engine.relocate(blob, 5, 5 * 256, "k" * 64)
    info = codec.inspect_chunk(moved)
    assert (info.index, info.start_token, info.tokens, info.key) == (5, 1280, 256, "k" * 64)
    out = torch.empty_like(kv)
    codec.decode_chunk(moved, out)
    assert torch.equal(out, kv)  # the payload is untouched


@pytest.mark.parametrize("method", ["cachegen", "kvcodec-int8"])
def test_a_stored_prefix_of_relocated_seeds_restores_whole(method):
    """build_store's chunks pass the fetch's checks (a baseline's header keeps naming its baseline:
    rewritten to the codec id, every CacheGen-style chunk was refused and the run restored nothing)."""
    from kvcodec.fetcher import PrefixCache
    from kvcodec.store import open_store

    codec = method_codec(method, ttft_engine.codec_config(), resolutions=((256, 256),))
    kv = real_like_kv(2 * 256)
    seeds = [c.blobs[0] for c in codec.encode_chunks(kv, keys=["seed-0", "seed-1"])]
    pc = PrefixCache(open_store("memory://"), ttft_engine.MODEL_ID, codec, "cpu", policy="fixed:0")
    ids = list(range(1000, 1000 + 3 * 256))
    assert ttft_engine.build_store(pc, ids, seeds, tuple(kv.shape[i] for i in (0, 3, 4))) > 0
    r = pc.fetch(ids)
    assert r.error is None and r.tokens_restored == len(ids)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """llama-tiny (4 layers, 2 KV heads, head_dim 64): a KV file of another shape, a .kvt of the
    target's shape, seed chunks of raw, zstd-3 and the transform at 5x."""
    from kvbench.workloads import tiled_kv

    d = tmp_path_factory.mktemp("ttft-engine")
    save_kv_file(d / "kv.safetensors", real_like_kv(300), {"model": "syn"})
    L, H, D = ttft_engine.target_shape("llama-tiny")
    cal_kv = tiled_kv(real_like_kv(600), L, H, D, 600)
    save_kvt(calibrate([cal_kv], RopeSpec(10000.0, D), info={"model": "tiny"}), d / "t.kvt")
    r = CliRunner().invoke(
        ttft_engine.command,
        [
            "prep",
            "--kv-file",
            str(d / "kv.safetensors"),
            "--target",
            "llama-tiny",
            "--transform",
            str(d / "t.kvt"),
            "--methods",
            "raw,zstd-3,kvcodec-transform",
            "--target-ratios",
            "5",
            "--dir",
            str(d / "prep"),
        ],
    )
    assert r.exit_code == 0, r.output
    return d


def test_prep_writes_seed_chunks_and_a_pack(prepared):
    man = json.loads((prepared / "prep" / ttft_engine.MANIFEST).read_text())
    assert man["shape"] == [4, 2, 64] and set(man["methods"]) == {"zstd-3", "kvcodec-transform-5"}
    from kvcodec.codecs.transform.codec import FRAME_SIZES

    # no --resolution: every method at its codec's own default frame size
    assert man["resolution"] is None
    assert man["methods"]["kvcodec-transform-5"]["resolutions"] == [list(r) for r in FRAME_SIZES]
    assert len(man["methods"]["kvcodec-transform-5"]["chunks"]) == ttft_engine.SEED_CHUNKS
    assert (prepared / "prep" / ttft_engine.PACK).exists()
    # the pack's codec is the prepared one (same id: same kvt hash) and reads its chunks
    codec = ttft_engine.run_codec("kvcodec-transform-5", prepared / "prep", man)
    assert codec.id == man["methods"]["kvcodec-transform-5"]["codec_id"]


def test_run_through_the_engine_measures_and_models(prepared):
    out = prepared / "ttft.json"
    r = CliRunner().invoke(
        ttft_engine.command,
        [
            "run",
            "--dir",
            str(prepared / "prep"),
            "--methods",
            "raw,zstd-3,kvcodec-transform",
            "--target-ratios",
            "5",
            "--tokens",
            "512",
            "--bandwidths",
            "1,1000",
            "--max-transfer-s",
            "0",
            "--device",
            "cpu",
            "--busy-seconds",
            "1",  # CUDA only: ignored on the CPU
            "--accuracy",
            str(RESULTS / "rd-smollm2-135m-cpu-s6.json"),
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    rec = json.loads(out.read_text())
    rows = {(x["method"], x["bandwidth_gbit"]): x for x in rec["rows"]}
    for m in ("raw", "zstd-3", "kvcodec-transform-5"):
        fast, slow = rows[(m, 1000.0)], rows[(m, 1.0)]
        assert fast["measured"] and fast["restored_tokens"] == 512 and fast["fetch_error"] is None
        assert len(fast["fetch_runs_s"]) == len(fast["ttft_runs_s"]) and fast["fetch_s"] == statistics.median(
            fast["fetch_runs_s"]
        )
        assert 0 < fast["first_fetch_s"] <= fast["first_ttft_s"] and "first_fetch_s" not in slow
        assert not any(k.startswith("first_pinned") for k in fast)  # the CPU: no pinned host memory
        assert not slow["measured"] and slow["fetch_s"] >= slow["transfer_s"]  # modelled: at least the transfer
        assert slow["bytes"] == fast["bytes"] > 0
    assert rows[("prefill", 1.0)]["measured"]
    assert not any("busy" in info for info in rec["inputs"]["methods"].values())
    assert accuracy_of(rec["accuracy"], "kvcodec-transform-5")["source"] == "rd-smollm2-135m-cpu-s6.json"
    md = out.with_suffix(".md").read_text()
    assert "Issue 21 target 4" in md and "*" in md and "first request's fetch s" in md


def test_plot_marks_modelled_points():
    from kvbench.plot import modelled_series, ttft_series

    rows = [
        {"model": "m", "tokens": 512, "method": "raw", "bandwidth_gbit": bw, "ttft_s": t, "measured": ok}
        for bw, t, ok in ((1.0, 2.0, False), (100.0, 0.1, True))
    ] + [{"model": "m", "tokens": 512, "method": "prefill", "bandwidth_gbit": 1.0, "ttft_s": 0.5}]
    assert ttft_series(rows)[("m", 512)]["raw"] == [(1.0, 2.0), (100.0, 0.1)]
    assert modelled_series(rows) == {("m", 512): {"raw": [(1.0, 2.0)]}}  # rows without the flag are measured


def test_link_bound_raw_is_the_link_time_plus_the_engine_time_after_the_fetch():
    def row(method, bw, ttft, fetch, measured=True):
        return {
            "model": "m",
            "tokens": 512,
            "bandwidth_gbit": bw,
            "method": method,
            "ttft_s": ttft,
            "fetch_s": fetch,
            "bytes": 10**9,
            "measured": measured,
            "restored_tokens": 512,
        }

    fastest_raw = row("raw", 100.0, 2.0, 1.9) | {"first_fetch_s": 3.0, "first_ttft_s": 3.1}  # the fetcher's own
    rows = [fastest_raw, row("raw", 1.0, 9.0, 8.9, measured=False), row("t", 1.0, 4.0, 3.9)]
    out = ttft_engine.with_raw_bound(rows)
    bound = {r["bandwidth_gbit"]: r for r in out if r["method"] == ttft_engine.RAW_BOUND}
    assert bound[100.0]["ttft_s"] == pytest.approx(0.08 + 0.1) and not bound[100.0]["measured"]
    assert not any(k.startswith("first_") for r in bound.values() for k in r)
    assert bound[1.0]["ttft_s"] == pytest.approx(8.0 + 0.1)  # a modelled raw point: the fastest link's time after
    t = next(r for r in out if r["method"] == "t")
    assert t["speedup_vs_raw_link_bound"] == pytest.approx(8.1 / 4.0)
    assert ttft_engine.with_raw_bound(out) == out  # idempotent


def test_prep_calibrates_the_targets_kvt_from_another_kv_file_and_codes_with_a_named_coder(tmp_path):
    save_kv_file(tmp_path / "kv.safetensors", real_like_kv(300), {"model": "syn"})
    save_kv_file(tmp_path / "other.safetensors", real_like_kv(500), {"model": "syn"})
    args = [
        "prep",
        "--kv-file",
        str(tmp_path / "kv.safetensors"),
        "--target",
        "llama-tiny",
        "--dir",
        str(tmp_path / "d"),
    ]
    r = CliRunner().invoke(
        ttft_engine.command,
        [*args, "--calibrate-kv-file", str(tmp_path / "other.safetensors"), "--methods", "kvcodec-transform-5-mixed"],
    )
    assert r.exit_code == 0, r.output
    man = json.loads((tmp_path / "d" / ttft_engine.MANIFEST).read_text())
    codec = ttft_engine.run_codec("kvcodec-transform-5-mixed", tmp_path / "d", man)
    assert codec.coder == "mixed" and codec.id == man["methods"]["kvcodec-transform-5-mixed"]["codec_id"]
    assert codec.cal.layers == 4 and (tmp_path / "d" / "target.kvt").exists()
    both = CliRunner().invoke(
        ttft_engine.command,
        [
            *args,
            "--transform",
            str(tmp_path / "d" / "target.kvt"),
            "--calibrate-kv-file",
            str(tmp_path / "other.safetensors"),
        ],
    )
    assert both.exit_code != 0 and "not both" in both.output
    none = CliRunner().invoke(ttft_engine.command, [*args, "--methods", "kvcodec-transform-5"])
    assert none.exit_code != 0 and "--calibrate-kv-file" in none.output


def test_a_mixed_transform_method_stores_hevc_and_zstd_chunks_in_turn_that_restore_alike(tmp_path):
    from kvcodec.fetcher import PrefixCache, blob_key
    from kvcodec.store import open_store

    L, H, D = ttft_engine.target_shape("llama-tiny")
    save_kv_file(tmp_path / "kv.safetensors", real_like_kv(300), {"model": "syn"})
    save_kvt(calibrate([tiled_kv_of(600, L, H, D)], RopeSpec(10000.0, D), info={"model": "tiny"}), tmp_path / "t.kvt")
    m = "kvcodec-transform-5-mixed"
    args = ["prep", "--kv-file", str(tmp_path / "kv.safetensors"), "--target", "llama-tiny", "--methods", m]
    r = CliRunner().invoke(
        ttft_engine.command, [*args, "--transform", str(tmp_path / "t.kvt"), "--dir", str(tmp_path / "d")]
    )
    assert r.exit_code == 0, r.output
    man = json.loads((tmp_path / "d" / ttft_engine.MANIFEST).read_text())
    codec = ttft_engine.run_codec(m, tmp_path / "d", man, tmp_path / "d" / ttft_engine.PACK)
    seeds = ttft_engine.seed_blobs(m, tmp_path / "d", man, codec)
    assert [codec.header(b)["coder"] for b in seeds] == ["hevc", "zstd", "hevc"]
    ids, c = list(range(6 * ttft_engine.CHUNK)), ttft_engine.CHUNK
    fetched, coders = [], []
    for chosen in (seeds, [seeds[0], seeds[2]], [seeds[0], seeds[1]]):  # in turn; HEVC alone; zstd after chunk 0
        pc = PrefixCache(open_store("memory://"), "syn", codec, "cpu", policy="fixed:0")
        ttft_engine.build_store(pc, ids, chosen, (L, H, D))
        got = pc.fetch(ids)
        assert got.ok and got.kv.shape[2] == len(ids)
        fetched.append(got.kv)
        coders.append([codec.header(pc.store.get(blob_key(k, 0)))["coder"] for k in pc.keys(ids)])
    assert coders == [["hevc", "zstd"] * 3, ["hevc"] * 6, ["hevc"] + ["zstd"] * 5]
    for i in range(1, 6):  # each chunk restores as the store of its coder alone restores it
        alone = fetched[2] if i % 2 else fetched[1]
        assert torch.equal(fetched[0][:, :, i * c : (i + 1) * c], alone[:, :, i * c : (i + 1) * c])


def test_an_ans_transform_method_stores_relocated_rans_chunks_that_restore_as_its_zstd_twin(tmp_path):
    """The method "kvcodec-transform-5-ans" (the same integers rANS-coded for the SMs): prep, relocation and the
    fetch's checks take its chunks, and they restore nearly what the default coder's chunks restore."""
    from kvcodec.fetcher import PrefixCache
    from kvcodec.store import open_store

    L, H, D = ttft_engine.target_shape("llama-tiny")
    save_kv_file(tmp_path / "kv.safetensors", real_like_kv(300), {"model": "syn"})
    save_kvt(calibrate([tiled_kv_of(600, L, H, D)], RopeSpec(10000.0, D), info={"model": "tiny"}), tmp_path / "t.kvt")
    methods = ["kvcodec-transform-5-ans", "kvcodec-transform-5"]
    kv_file = str(tmp_path / "kv.safetensors")
    args = ["prep", "--kv-file", kv_file, "--target", "llama-tiny", "--methods", ",".join(methods)]
    r = CliRunner().invoke(
        ttft_engine.command, [*args, "--transform", str(tmp_path / "t.kvt"), "--dir", str(tmp_path / "d")]
    )
    assert r.exit_code == 0, r.output
    man = json.loads((tmp_path / "d" / ttft_engine.MANIFEST).read_text())
    ids, restored = list(range(4 * ttft_engine.CHUNK)), []
    for m in methods:
        codec = ttft_engine.run_codec(m, tmp_path / "d", man, tmp_path / "d" / ttft_engine.PACK)
        assert codec.id == man["methods"][m]["codec_id"]
        pc = PrefixCache(open_store("memory://"), "syn", codec, "cpu", policy="fixed:0")
        ttft_engine.build_store(pc, ids, ttft_engine.seed_blobs(m, tmp_path / "d", man, codec), (L, H, D))
        got = pc.fetch(ids)
        assert got.ok and got.tokens_restored == len(ids)
        restored.append(got.kv)
    assert man["methods"][methods[0]]["codec_id"].startswith("transform-ans")
    a, b = (x.float() for x in restored)  # each coder's bytes set its quantizer's level: close, not equal
    assert (a - b).norm() / b.norm() < 0.1


def tiled_kv_of(tokens: int, layers: int, heads: int, dim: int) -> torch.Tensor:
    from kvbench.workloads import tiled_kv

    return tiled_kv(real_like_kv(tokens), layers, heads, dim, tokens)


def test_the_busy_table_shows_each_methods_fetch_beside_the_matmul():
    busy = {
        "tokens": 8192,
        "restored_gb_per_s_alone": 9.1,
        "host_cores_alone": 2.44,
        "restored_gb_per_s_beside": 6.2,
        "matmul_tflops_alone": 700.0,
        "matmul_slowdown": 0.031,
    }
    rec = {
        "inputs": {
            "methods": {"kvcodec-transform-5": {"busy": [busy]}, "raw": {}},
        }
    }
    md = "\n".join(ttft_engine.busy_markdown(rec))
    assert "| kvcodec-transform 5x | 8192 | 9.10 | 2.4 | 6.20 | 700 | 3.1% |" in md and "raw fp16" not in md
    del busy["host_cores_alone"]  # a record of before the column: a dash
    assert "| kvcodec-transform 5x | 8192 | 9.10 | - | 6.20 |" in "\n".join(ttft_engine.busy_markdown(rec))
    assert ttft_engine.busy_markdown({"inputs": {"methods": {"raw": {}}}}) == []


def test_the_busy_table_says_how_the_rate_alone_was_measured():
    busy = {"tokens": 8192, "restored_gb_per_s_alone": 9.1, "restored_gb_per_s_beside": 6.2}
    busy |= {"matmul_tflops_alone": 700.0, "matmul_slowdown": 0.031}
    rec = {"inputs": {"methods": {"kvcodec-transform-5": {"busy": [busy]}}}}
    assert "restored alone (median;" in "\n".join(ttft_engine.busy_markdown(rec))  # a record of before calls_alone
    busy["calls_alone"] = 40
    assert "restored alone (looping as long as beside the matmul;" in "\n".join(ttft_engine.busy_markdown(rec))


def test_the_fetches_alone_loop_for_the_least_calls_and_the_least_time():
    calls = []
    n, seconds, cores = ttft_engine._looped(lambda: calls.append(1), 5, 0.0)
    assert n == len(calls) == 5 and seconds > 0 and cores >= 0
    clock = iter(range(100))  # a fake clock read once at the start and once per check after the least calls
    n, seconds, _ = ttft_engine._looped(lambda: None, 2, 6.5, clock=lambda: float(next(clock)))
    assert (n, seconds) == (8, 8.0)  # 2 calls, then one per check that reads under 6.5 (1..6); 7 stops; 8 ends


def test_the_busy_table_adds_a_column_pair_per_further_queue_depth():
    busy = {
        "tokens": 32768,
        "restored_gb_per_s_alone": 9.1,
        "restored_gb_per_s_beside": 6.2,
        "matmul_tflops_alone": 700.0,
        "matmul_slowdown": 0.071,
        "matmul_queued": 1,
        "matmul_slowdown_queued_2": 0.024,
        "restored_gb_per_s_beside_queued_2": 6.9,
    }
    md = "\n".join(ttft_engine.busy_markdown({"inputs": {"methods": {"kvcodec-transform-8": {"busy": [busy]}}}}))
    assert "| slowed, 2 queued |" in md and "|---|---|---|---|---|---|---|---|---|" in md
    assert "| kvcodec-transform 8x | 32768 | 9.10 | - | 6.20 | 700 | 7.1% | 6.90 | 2.4% |" in md


def test_a_bad_resolution_or_busy_time_is_a_usage_error_before_any_work(tmp_path):
    save_kv_file(tmp_path / "kv.safetensors", real_like_kv(300), {"model": "syn"})
    args = ["prep", "--kv-file", str(tmp_path / "kv.safetensors"), "--target", "llama-tiny", "--methods", "zstd-3"]
    for bad in ("12x", "abc", "512x512,256x256", "0x512"):
        r = CliRunner().invoke(ttft_engine.command, [*args, "--resolution", bad, "--dir", str(tmp_path / "d")])
        assert r.exit_code == 2 and "--resolution" in r.output and not (tmp_path / "d").exists()
    r = CliRunner().invoke(ttft_engine.command, ["run", "--dir", str(tmp_path), "--busy-seconds", "-1"])
    assert r.exit_code == 2 and "--busy-seconds" in r.output
    for bad in ("0", "two", ""):
        r = CliRunner().invoke(ttft_engine.command, ["run", "--dir", str(tmp_path), "--busy-queued", bad])
        assert r.exit_code == 2 and "--busy-queued" in r.output, r.output


def test_the_notes_say_whether_the_weights_were_random():
    from kvbench.ttft_engine import notes

    assert "random weights (timing only)" in notes(True, None) and "real weights" not in notes(True, None)
    assert "its real weights" in notes(False, "x") and "random" not in notes(False, "x").replace("random fp16", "")


def test_a_model_folder_saved_again_gets_another_cache_tag(tmp_path):
    # prefilled KV was cached under the folder's path: a model saved again there got the old model's KV
    import os

    from kvbench.workloads import model_tag

    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"a" * 10)
    first = model_tag(str(folder))
    (folder / "model.safetensors").write_bytes(b"b" * 12)
    assert model_tag(str(folder)) != first and first.startswith("tiny-") and os.sep not in first
    assert model_tag("smollm2-135m") == "smollm2-135m"


def test_a_text_file_gets_a_cache_tag_of_its_contents(tmp_path):
    from kvbench.workloads import text_tag

    own = tmp_path / ("n" * 300 + ".txt")[:200]
    own.write_text("one")
    first = text_tag(str(own))
    own.write_text("two")
    assert text_tag(str(own)) != first and len(first) < 100 and "/" not in first
    assert text_tag("pg/apple") == "pg_apple"
