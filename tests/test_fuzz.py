"""Seeded, time-bounded fuzzing of real containers and store entries (the cases live in
benchmarks/probes/reliability.py and store_fuzz.py, which also write the reliability results).

Every damaged or forged input must give a KVCodecError or exactly the original data; a forgery
that rewrites content together with its checksums may decode to other values, but always to
fully written output. KVCODEC_FUZZ_SECONDS (default 20, per test; the first 3 seeded rounds of
every category always run) and KVCODEC_FUZZ_SEED set the budget."""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "probes"))
import reliability  # noqa: E402
import store_fuzz  # noqa: E402

SECONDS = float(os.environ.get("KVCODEC_FUZZ_SECONDS", "20"))
SEED = int(os.environ.get("KVCODEC_FUZZ_SEED", "20261201"))
CHUNK = 32


@pytest.fixture(scope="module")
def kv(smollm2):
    torch.manual_seed(0)
    return reliability.real_kv(2 * CHUNK + 1, smollm2)  # two full chunks and a one-token (plain) tail


def test_fuzzed_files_give_a_clear_error_or_the_original(kv):
    subjects = reliability.subjects_from(kv, CHUNK)
    rss0 = reliability.peak_rss_mb()
    tally = reliability.Tally()
    reliability.fuzz_files(subjects, SEED, SECONDS, tally)
    assert not tally.violations, tally.violations[:5]
    for category in reliability.FILE_CATEGORIES:
        counts = tally.outcomes[category]
        assert sum(counts.values()) >= 6, (category, counts)
        assert counts["error"] + counts["altered"] > 0, (category, counts)  # the mutations do bite
    assert tally.max_case_s < 60  # a case that loops or inflates is caught; not a speed check (cases take < 1 s)
    assert tally.max_announced_bytes <= kv.numel() * kv.element_size()
    assert reliability.peak_rss_mb() - rss0 < 1024


def test_fuzzed_store_entries_never_serve_wrong_data_and_heal(kv):
    tally = store_fuzz.fuzz_store(kv, CHUNK, SEED, cases=120, seconds=SECONDS, min_cases=18)
    assert not tally.violations, tally.violations[:5]
    assert set(tally.outcomes) == set(store_fuzz._mutations(["a", "b"], ["c", "d"]))
    for category, counts in tally.outcomes.items():
        if category != "store-meta-edit":  # a meta edit can be harmless (e.g. a field added)
            assert counts["error"] > 0, (category, counts)
