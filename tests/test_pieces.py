"""Pure functions behind a chunk's video pieces: the frame size a chunk's samples get
(transform.frames.frame_size), how many pieces a fetch cuts each chunk into (driven.split_for) and
where (driven.balanced_runs)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from kvcodec.codecs.driven import PIECES_PER_SESSION, balanced_runs, split_for
from kvcodec.transform.frames import MIN_SIDE, frame_count, frame_size

sides = st.sampled_from([16, 64, 256, 270, 512, 1000, 1024, 1080, 1920, 2048])


@given(st.integers(1, 1 << 26), sides, sides, st.integers(1, 16))
def test_frames_shrink_only_while_a_chunk_fills_too_few_and_stay_large_enough(samples, w, h, least):
    fw, fh = frame_size(samples, (w, h), least)
    assert fw <= w and fh <= h and w % fw == 0 and h % fh == 0
    assert fw >= min(w, MIN_SIDE) and fh >= min(h, MIN_SIDE)
    if (fw, fh) != (w, h):  # shrunk: the larger size before the last halving held too few frames
        assert frame_count(samples, 2 * fw, fh) < least or frame_count(samples, fw, 2 * fh) < least
    if frame_count(samples, fw, fh) < least:  # too few frames: the frames could shrink no further
        assert (fh < 2 * MIN_SIDE or fh % 4) and (fw < 2 * MIN_SIDE or fw % 4)


def test_frame_sizes_of_a_small_models_chunks():
    """Qwen2.5-0.5B's 256-token chunk at 5x (~1.44M samples) keeps its one 1024x1024 frame by
    default; asked for 4 frames it takes 4 of 512x256 (not 8 of 256x256: frames are whole); a
    chunk that takes 4 frames of 1024x1024 keeps them."""
    assert frame_size(1_440_512, (1024, 1024)) == (1024, 1024)
    assert frame_size(1_440_512, (1024, 1024), 4) == (512, 256)
    assert frame_size(3 * 3 * 1024 * 1024 + 1, (1024, 1024), 4) == (1024, 1024)
    assert frame_size(3 * 3 * 1024 * 1024, (1024, 1024), 4) == (1024, 512)


@given(st.integers(1, 4096), st.integers(1, 64))
def test_a_fetch_cuts_fewer_pieces_the_more_chunks_it_has(chunks, sessions):
    k = split_for(chunks, sessions)
    assert k >= 1 and chunks * k >= PIECES_PER_SESSION * sessions
    assert k == 1 or chunks * (k - 1) < PIECES_PER_SESSION * sessions
    assert split_for(chunks + 1, sessions) <= k


def _largest(sizes, runs):
    return max(sum(sizes[a:b]) for a, b in runs)


@given(st.lists(st.integers(1, 1000), min_size=1, max_size=7), st.integers(1, 9))
def test_balanced_runs_cover_the_pieces_in_order_with_the_smallest_largest_run(sizes, most):
    runs = balanced_runs(sizes, most)
    assert runs[0][0] == 0 and runs[-1][1] == len(sizes) and len(runs) <= most
    assert all(a < b for a, b in runs) and all(r[1] == s[0] for r, s in zip(runs, runs[1:]))
    best = min(  # every way to cut the list into at most `most` runs
        _largest(sizes, list(zip((0, *cuts), (*cuts, len(sizes)))))
        for k in range(min(most, len(sizes)))
        for cuts in itertools.combinations(range(1, len(sizes)), k)
    )
    assert _largest(sizes, runs) == best


def test_balanced_runs_of_nothing_and_of_one_run():
    assert balanced_runs([], 4) == []
    assert balanced_runs([5, 6, 7], 1) == [(0, 3)]
    assert balanced_runs([145, 107, 91, 80, 71, 60, 47, 11], 4) == [(0, 1), (1, 2), (2, 4), (4, 8)]
