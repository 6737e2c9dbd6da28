"""`kvcodec ingest --ray`: the same job on a local two-node Ray cluster (prefill actor on one node,
encode tasks wherever CPUs are free) stores byte-identical objects to the one-machine run, skips
them on a second run and reports a bad document. Skipped only where ray cannot be imported (CI
installs the ray extra and sets KVCODEC_REQUIRE_RAY=1, so a missing ray fails there)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

if os.environ.get("KVCODEC_REQUIRE_RAY"):
    import ray
else:
    ray = pytest.importorskip("ray")

from kvcodec.cli.main import cli  # noqa: E402
from kvcodec.codecs import make_codec  # noqa: E402
from kvcodec.fetcher import PrefixCache  # noqa: E402
from kvcodec.ingest import Document, ingest  # noqa: E402
from kvcodec.ingest.distributed import RayJob, ingest_on_ray  # noqa: E402
from kvcodec.models import model_id  # noqa: E402
from kvcodec.store import open_store  # noqa: E402

DOCS = [
    Document("mill", "The river ran past the old mill, where the miller kept a canoe tied to a post. " * 3),
    Document("light", "A lighthouse keeper counted ships at night and wrote each name in a blue book. " * 3),
    Document("bad", error="not JSON"),
    Document("empty", ""),
]
OPTIONS = (("chunk_tokens", 32),)


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    small = {"num_cpus": 2, "object_store_memory": 80 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False})
    cluster.add_node(**small)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_ray_ingest_stores_the_bytes_of_a_one_machine_run(smollm2, tmp_path, two_nodes):
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    model, tokenizer = smollm2
    here = tmp_path / "here"
    cache = PrefixCache(open_store(f"file://{here}"), model_id(model), make_codec("hevc", **dict(OPTIONS)), "cpu")
    local = ingest(DOCS, model, tokenizer, cache).to_dict()
    job = RayJob(
        "smollm2-135m", f"file://{tmp_path / 'ray'}", "hevc", OPTIONS, encode_cpus=1, threads=torch.get_num_threads()
    )
    seen = []
    report = ingest_on_ray(DOCS, job, on_result=seen.append).to_dict()
    assert (
        (report["stored"], report["skipped"], report["failed"])
        == (2, 0, 2)
        == (
            local["stored"],
            local["skipped"],
            local["failed"],
        )
    )
    assert [r.id for r in seen] == [d.id for d in DOCS]  # in document order, though the failures come first
    assert (
        len(seen) == 4
        and "no tokens" in {e["id"]: e["error"] for e in report["errors"]}["empty"]
        and report["chunks"] == local["chunks"] > 0
    )
    ours, theirs = _files(here), _files(tmp_path / "ray")
    assert sorted(ours) == sorted(theirs) and ours == theirs  # the same keys, byte for byte
    jl = tmp_path / "docs.jsonl"  # the command, connected to the same cluster: everything is stored already
    jl.write_text("\n".join([*(json.dumps({"id": d.id, "text": d.text}) for d in DOCS[:2]), "{broken", '""']) + "\n")
    args = ["ingest", str(jl), "--model", "smollm2-135m", "--store", job.store_url, "--codec", "hevc"]
    args += ["--codec-option", "chunk_tokens=32", "--ray", two_nodes.address, "--encode-cpus", "1"]
    again = CliRunner().invoke(cli, args)
    assert again.exit_code == 1 and "0 stored, 2 already stored, 2 failed" in again.output, again.output


def test_ray_ingest_stores_a_repeat_once_and_waits_for_a_store_that_is_down(smollm2, tmp_path, two_nodes, redis_server):
    """As on one machine: a repeat settles with its first document's store (stored once), and a store
    that does not answer stops the job after its patience with the first document reported."""
    from kvcodec.ingest.run import StoreDownError

    docs = [DOCS[0], Document("mill-again", DOCS[0].text), DOCS[1]]
    job = RayJob("smollm2-135m", f"file://{tmp_path / 'ray'}", "hevc", OPTIONS, encode_cpus=1)
    report = ingest_on_ray(docs, job)
    got = {r.id: r for r in report.results}
    assert (got["mill"].status, got["light"].status) == ("stored", "stored")
    again = got["mill-again"]  # told of mill's store in flight, or prefilled beside it, or looked up once stored
    assert again.status == "skipped" and (again.error is None or "same tokens as mill" in again.error)
    assert again.store_s == 0  # not encoded again
    assert [r.id for r in report.results] == ["mill", "mill-again", "light"]
    assert report.to_dict()["chunks"] == got["mill"].chunks + got["light"].chunks
    redis_server.kill()
    seen = []
    down = dataclasses.replace(job, store_url=redis_server.url)
    with pytest.raises(StoreDownError, match="resume"):
        ingest_on_ray(docs, down, on_result=seen.append, store_patience_s=0)
    assert [(r.id, r.status) for r in seen] == [("mill", "failed")]
