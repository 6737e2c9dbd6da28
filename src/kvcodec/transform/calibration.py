"""Calibration: a mean and an orthonormal basis per (group of layers, K or V), fitted on KV of
texts the codec will not be evaluated on. Keys are fitted with RoPE removed when the rotary
settings are known. Sink tokens (the first few positions, whose KV are outliers) are left out."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from kvcodec.errors import ConfigError, ShapeError
from kvcodec.transform.pca import TARGET_TOKENS_PER_DIM, fit_pca, group_layers
from kvcodec.transform.rope import RopeSpec, remove_rope

KINDS = ("k", "v")
DEFAULT_SINK_TOKENS = 4
# The essays the project evaluates the transform on (docs/TRANSFORM.md): never calibrate on them.
HELD_OUT_TEXTS = (
    "pg/web20",
    "pg/gap",
    "pg/love",
    "pg/popular",
    "pg/want",
    "pg/wisdom",
    "pg/worked",
    "pg/useful",
)
# Texts of other kinds than the essays the project evaluates on (issue 23 target 3): never calibrate on them.
KIND_EVAL_TEXTS = ("py/json.decoder", "py/difflib", "doc/json", "doc/difflib", "dlg/37", "dlg/42")
# Python source code and pydoc documentation (the standard library's: always installed) the default
# calibration mixes with the essays, disjoint from KIND_EVAL_TEXTS; dialogue (dlg/) needs an optional
# download, so it is left to evaluation.
CODE_POOL = ("py/textwrap", "py/argparse", "py/dataclasses", "py/logging", "py/string", "py/shlex")
DOC_POOL = ("doc/pathlib", "doc/itertools", "doc/functools", "doc/collections", "doc/subprocess", "doc/csv")
# Calibration essays in the order they are taken (the first N of them), disjoint from HELD_OUT_TEXTS.
CALIBRATION_POOL = (
    "pg/addiction",
    "pg/aord",
    "pg/apple",
    "pg/avg",
    "pg/before",
    "pg/bias",
    "pg/boss",
    "pg/copy",
    "pg/corpdev",
    "pg/desres",
    "pg/diff",
    "pg/ecw",
    "pg/founders",
    "pg/foundervisa",
    "pg/gba",
    "pg/gh",
    "pg/goodtaste",
    "pg/hubs",
    "pg/iflisp",
    "pg/island",
    "pg/know",
    "pg/langdes",
    "pg/laundry",
    "pg/mod",
    "pg/newideas",
    "pg/nft",
    "pg/philosophy",
    "pg/pow",
    "pg/rootsoflisp",
    "pg/rss",
    "pg/siliconvalley",
    "pg/startuplessons",
    "pg/submarine",
    "pg/sun",
    "pg/superangels",
    "pg/todo",
    "pg/unions",
    "pg/vb",
    "pg/vcsqueeze",
    "pg/vw",
    "pg/weird",
)


def mixed_texts(essays: int, code: int, docs: int) -> tuple[str, ...]:
    """The first `essays` of CALIBRATION_POOL, `code` of CODE_POOL and `docs` of DOC_POOL, interleaved
    essay, code, doc, essay, ... (the Fisher weights are measured on the first few: every kind)."""
    if essays > len(CALIBRATION_POOL) or code > len(CODE_POOL) or docs > len(DOC_POOL):
        raise ConfigError(f"the pools hold {len(CALIBRATION_POOL)} essays, {len(CODE_POOL)} code, {len(DOC_POOL)} docs")
    kinds = [list(CALIBRATION_POOL[:essays]), list(CODE_POOL[:code]), list(DOC_POOL[:docs])]
    out = []
    while any(kinds):
        out += [k.pop(0) for k in kinds if k]
    return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)
class GroupBasis:
    """One group's transform for K or V: x ~ mean + basis @ y, variances of y (descending).
    With channel weights w (a weighted KLT, weights.py) basis = B / sqrt(w) for an orthonormal B,
    and y = analysis^T (x - mean) with analysis = w * basis."""

    mean: torch.Tensor  # (d,) float32
    basis: torch.Tensor  # (d, d) float32: synthesis; orthonormal columns when unweighted
    variances: torch.Tensor  # (d,) float32, of the (weighted) coefficients
    weights: torch.Tensor | None = None  # (d,) float32 channel weights, None: plain MSE

    @property
    def analysis(self) -> torch.Tensor:
        return self.basis if self.weights is None else self.basis * self.weights[:, None]


@dataclasses.dataclass(frozen=True, eq=False)
class Calibration:
    layers: int
    kv_heads: int
    head_dim: int
    rope: RopeSpec | None  # None: keys are transformed as stored (with RoPE)
    groups: tuple[tuple[int, ...], ...]
    bases: dict[tuple[int, str], GroupBasis]  # (group index, "k" | "v")
    info: dict[str, Any]  # model, tokens, sources, sink_tokens: descriptive only

    @property
    def layer_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def basis(self, group: int, kind: str) -> GroupBasis:
        return self.bases[(group, kind)]

    def check_shape(self, shape: Sequence[int]) -> None:
        want = (self.layers, 2, self.kv_heads, self.head_dim)
        have = (shape[0], shape[1], shape[3], shape[4]) if len(shape) == 5 else tuple(shape)
        if have != want:
            raise ShapeError(
                f"KV of shape (layers, 2, heads, dim) {have} does not match the transform's {want} "
                f"(calibrated for {self.info.get('model', 'another model')})"
            )


def group_matrix(x: torch.Tensor, layers: Sequence[int], kind: int) -> torch.Tensor:
    """(tokens, len(layers) * heads * dim) view of kv[layers, kind] (kv: layers, 2, T, H, D)."""
    sel = x[list(layers), kind] if len(layers) != x.shape[0] else x[:, kind]
    g, t, h, d = sel.shape
    return sel.permute(1, 0, 2, 3).reshape(t, g * h * d)


def keys_without_rope(kv: torch.Tensor, first_position: int, rope: RopeSpec | None) -> torch.Tensor:
    """kv (layers, 2, T, H, D) as float32 with RoPE removed from its keys (positions first_position..)."""
    x = kv.to(torch.float32)
    if rope is None:
        return x
    positions = torch.arange(first_position, first_position + x.shape[2], device=x.device)
    return torch.stack([remove_rope(x[:, 0], positions, rope), x[:, 1]], dim=1)


FLOAT16_MAX = 65504.0


def _check(kvs: Sequence[torch.Tensor]) -> tuple[int, int, int]:
    if not kvs:
        raise ConfigError("calibration needs at least one KV tensor")
    shapes = {(k.shape[0], k.shape[3], k.shape[4]) if k.dim() == 5 else None for k in kvs}
    if None in shapes or any(k.shape[1] != 2 for k in kvs):
        raise ShapeError("calibration KV must be (layers, 2, tokens, kv_heads, head_dim)")
    if len(shapes) != 1:
        raise ShapeError(f"calibration KV files come from different models: shapes {sorted(shapes)}")
    for k in kvs:
        if not torch.isfinite(k).all():
            raise ConfigError("calibration KV holds NaN or infinity; refusing to fit a transform on it")
        refuse_beyond_half(float(k.abs().amax()) if k.numel() else 0.0, "calibration KV")
    return next(iter(shapes))


def refuse_beyond_half(peak: float, what: str) -> None:
    """ShapeError where KV's largest magnitude `peak` is beyond float16's range: a .kvt stores its means in
    float16's range and the transform codec its exact sink tokens as float16, so such KV cannot be coded by the
    transform (the HEVC codec's integer modes code it)."""
    if peak > FLOAT16_MAX:
        raise ShapeError(
            f"{what} reaches {peak:.6g}, beyond float16's range ({FLOAT16_MAX:g}): the transform codes KV within "
            "it; the HEVC codec (--quant int8) codes this KV"
        )


def calibrate(
    kvs: Sequence[torch.Tensor],
    rope: RopeSpec | None,
    *,
    sink_tokens: int = DEFAULT_SINK_TOKENS,
    tokens_per_dim: float = TARGET_TOKENS_PER_DIM,
    max_group: int | None = None,
    weights: torch.Tensor | None = None,
    covariance: str = "sample",
    info: dict[str, Any] | None = None,
    held_out: Sequence[torch.Tensor] = (),
    first_position: int = 0,
) -> Calibration:
    """Fit per-group bases on KV tensors whose first token is at `first_position`; with channel
    weights (layers, 2, heads, dim), weighted KLTs (weights.py); covariance names the estimator
    (pca.COVARIANCES). With `held_out` KV (tensors of the same model not fitted on), every
    (group, K|V) whose basis codes them less accurately than per-channel int-N of the same or fewer
    bytes falls back to per-channel coding (fallback.py); info["fallback"] names those blocks. The bases are returned as a
    version-3 .kvt stores them (kvt.compact: float16, coordinates no ratio >= 2 codes dropped)."""
    layers, heads, dim = _check(kvs)
    if rope is not None and rope.head_dim != dim:
        raise ConfigError(f"rope head_dim {rope.head_dim} does not match the KV's head_dim {dim}")
    sink = max(0, sink_tokens - first_position)
    tokens = sum(max(0, k.shape[2] - sink) for k in kvs)
    groups = group_layers(layers, heads * dim, tokens, tokens_per_dim=tokens_per_dim, max_group=max_group)
    if weights is not None and (tuple(weights.shape) != (layers, 2, heads, dim) or not bool((weights > 0).all())):
        raise ConfigError(f"channel weights must be positive, of shape {(layers, 2, heads, dim)}")
    if held_out:
        _check([*kvs, *held_out])
    bases, diagonals = {}, {}
    for gi, group in enumerate(groups):
        for ki, kind in enumerate(KINDS):
            moments = _moments(block_samples(k, group, ki, first_position, rope, sink) for k in kvs)
            samples = None
            if covariance != "sample":  # estimators that need the samples themselves
                samples = torch.cat([block_samples(k, group, ki, first_position, rope, sink) for k in kvs])
            _fit_block(bases, diagonals, (gi, kind), moments, _block_weights(weights, group, ki), bool(held_out),
                       samples, covariance)  # fmt: skip
            del moments, samples  # one block's covariance at a time
    meta = dict(info or {})
    meta.update(tokens=tokens, sink_tokens=sink_tokens, tokens_per_dim=tokens_per_dim)
    if covariance != "sample":
        meta["covariance"] = covariance
    return _finish(layers, heads, dim, rope, groups, bases, diagonals, meta, held_out, first_position, sink)


def _block_weights(weights: torch.Tensor | None, group: Sequence[int], kind: int) -> torch.Tensor | None:
    return None if weights is None else weights[list(group), kind].reshape(-1).to(torch.float64)


def _fit_block(bases: dict, diagonals: dict, key, moments, w, held: bool, samples=None, covariance="sample") -> None:  # noqa: ANN001
    """bases[key] from a block's (mean, covariance, count) (or its samples, for other estimators);
    with held-out data, diagonals[key]: its per-channel fallback from the same moments. Moments on a
    GPU (StreamedCalibration of KV there) are decomposed there; what is kept comes back to the CPU."""
    mean, cov, n = moments
    if samples is None:
        bases[key] = _on_cpu(fit_moments(mean, cov, None if w is None else w.to(cov.device)))
    else:
        bases[key] = fit_group(samples, w, covariance)
    if held:
        from kvcodec.transform.fallback import diagonal_from_moments

        diagonals[key] = diagonal_from_moments(mean.cpu(), torch.diagonal(cov).cpu() * ((n - 1) / n), w)


def _on_cpu(b: GroupBasis) -> GroupBasis:
    """b with its tensors on the CPU (itself when they are there)."""
    if b.mean.device.type == "cpu":
        return b
    return GroupBasis(*(None if t is None else t.cpu() for t in (b.mean, b.basis, b.variances, b.weights)))


def _finish(layers, heads, dim, rope, groups, bases, diagonals, meta, held_out, first_position, sink) -> Calibration:  # noqa: ANN001
    """The fitted Calibration: held-out fallback decided, bases compacted as a version-3 .kvt stores them."""
    if held_out:
        held = [lambda g, k, h=h: block_samples(h, groups[g], k, first_position, rope, sink) for h in held_out]
        meta["fallback"] = _fall_back(bases, diagonals, held)
        meta["held_out_tokens"] = sum(max(0, h.shape[2] - sink) for h in held_out)
    from kvcodec.transform.kvt import compact  # float16 bases cut to the coordinates a ratio codes

    return compact(Calibration(layers, heads, dim, rope, groups, bases, meta))


def block_samples(
    kv: torch.Tensor, layers: Sequence[int], kind: int, first_position: int, rope: RopeSpec | None, sink: int
) -> torch.Tensor:
    """(tokens - sink, len(layers) * heads * dim) float32 samples of kv[layers, kind], keys with
    RoPE removed (kv's first token at first_position), the first `sink` tokens left out."""
    sel = kv[list(layers), kind].to(torch.float32)
    if kind == 0 and rope is not None:
        positions = torch.arange(first_position, first_position + kv.shape[2], device=kv.device)
        sel = remove_rope(sel, positions, rope)
    g, t, h, d = sel.shape
    return sel[:, sink:].permute(1, 0, 2, 3).reshape(t - min(sink, t), g * h * d)


def _moments(parts) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(mean, unbiased covariance, count) in float64 of sample matrices given one by one: float32
    products of samples shifted by the first part's mean (no cancellation), summed in float64."""
    acc = _Accumulator()
    for x in parts:
        acc.add(x)
    return acc.moments()


class _Accumulator:
    """Running sums of one block's samples (see _moments)."""

    def __init__(self) -> None:
        self.shift = self.s1 = self.s2 = None
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        if not torch.isfinite(x).all():
            raise ConfigError("calibration data holds NaN or infinity; refusing to fit a transform on it")
        if self.shift is None:
            self.shift = x.mean(0)
            self.s1 = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)  # where the samples are
            self.s2 = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64, device=x.device)
        c = x - self.shift
        self.s1 += c.sum(0, dtype=torch.float64)
        self.s2 += (c.T @ c).to(torch.float64)
        self.n += x.shape[0]

    def moments(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        n = self.n
        if n < 2:
            raise ConfigError(f"PCA needs >= 2 samples; got {n}")
        m = self.s1 / n
        cov = (self.s2 - n * torch.outer(m, m)) / (n - 1)
        return self.shift.to(torch.float64) + m, cov, n


class StreamedCalibration:
    """calibrate() on KV given one tensor at a time and dropped after it (the "sample" covariance
    only): the fit's memory is the running moments of every block, not the calibration KV. The
    tokens must be counted first (they decide the layer groups); finish() checks the count.

        stream = StreamedCalibration((layers, heads, dim), rope, tokens=n)
        for kv in kvs: stream.add(kv)
        cal = stream.finish(weights=w, info=info, held_out=held)

    The result equals calibrate(kvs, rope, ...) on the same tensors in the same order. KV on a GPU is
    summed there (float64 sums of float32 products) and each block's eigendecomposition runs there
    (a 3072-dim block: seconds to a minute on a few CPU cores); the bases, the held-out fallback
    check and the result are on the CPU."""

    def __init__(
        self,
        shape: tuple[int, int, int],
        rope: RopeSpec | None,
        *,
        tokens: int,
        sink_tokens: int = DEFAULT_SINK_TOKENS,
        tokens_per_dim: float = TARGET_TOKENS_PER_DIM,
        max_group: int | None = None,
        first_position: int = 0,
    ) -> None:
        layers, heads, dim = shape
        if rope is not None and rope.head_dim != dim:
            raise ConfigError(f"rope head_dim {rope.head_dim} does not match the KV's head_dim {dim}")
        self.shape, self.rope, self.tokens, self.first_position = tuple(shape), rope, tokens, first_position
        self.sink_tokens, self.tokens_per_dim = sink_tokens, tokens_per_dim
        self.sink = max(0, sink_tokens - first_position)
        self.groups = group_layers(layers, heads * dim, tokens, tokens_per_dim=tokens_per_dim, max_group=max_group)
        self.blocks = {(gi, kind): _Accumulator() for gi in range(len(self.groups)) for kind in KINDS}
        self.seen = 0

    def add(self, kv: torch.Tensor) -> None:
        if _check([kv]) != self.shape:
            raise ShapeError(f"calibration KV of shape {tuple(kv.shape)} does not match the first ones' {self.shape}")
        for gi, group in enumerate(self.groups):
            for ki, kind in enumerate(KINDS):
                self.blocks[(gi, kind)].add(block_samples(kv, group, ki, self.first_position, self.rope, self.sink))
        self.seen += max(0, kv.shape[2] - self.sink)

    def finish(
        self,
        *,
        weights: torch.Tensor | None = None,
        info: dict[str, Any] | None = None,
        held_out: Sequence[torch.Tensor] = (),
    ) -> Calibration:
        layers, heads, dim = self.shape
        if self.seen != self.tokens:
            raise ConfigError(f"the calibration KV held {self.seen} tokens, {self.tokens} were counted for the groups")
        if weights is not None and (tuple(weights.shape) != (layers, 2, heads, dim) or not bool((weights > 0).all())):
            raise ConfigError(f"channel weights must be positive, of shape {(layers, 2, heads, dim)}")
        for h in held_out:
            if _check([h]) != self.shape:
                raise ShapeError("held-out KV comes from another model than the calibration KV")
        bases, diagonals = {}, {}
        for (gi, kind), acc in self.blocks.items():
            w = _block_weights(weights, self.groups[gi], KINDS.index(kind))
            _fit_block(bases, diagonals, (gi, kind), acc.moments(), w, bool(held_out))
            acc.s2 = None  # the running sums are spent
        meta = dict(info or {})
        meta.update(tokens=self.tokens, sink_tokens=self.sink_tokens, tokens_per_dim=self.tokens_per_dim)
        args = (self.rope, self.groups, bases, diagonals, meta, held_out, self.first_position, self.sink)
        return _finish(layers, heads, dim, *args)


def streamed_token_count(
    lengths: Iterable[int], sink_tokens: int = DEFAULT_SINK_TOKENS, first_position: int = 0
) -> int:
    """The tokens calibrate() fits on from KV of these lengths (sink tokens left out of each)."""
    sink = max(0, sink_tokens - first_position)
    return sum(max(0, n - sink) for n in lengths)


def fit_moments(mean: torch.Tensor, cov: torch.Tensor, w: torch.Tensor | None) -> GroupBasis:
    """The (weighted) KLT from a float64 mean and covariance: eigenvectors of the covariance of
    sqrt(w) x, computed in float32 (the .kvt keeps float16 bases), basis scaled back by 1/sqrt(w)."""
    sw = torch.ones_like(mean) if w is None else w.sqrt()
    var, vec = torch.linalg.eigh((cov * sw[:, None] * sw[None, :]).to(torch.float32))
    order = torch.argsort(var, descending=True)
    basis = vec[:, order].to(torch.float64) / sw[:, None]
    return GroupBasis(mean.float(), basis.float(), var[order].clamp_min(0.0).float(), None if w is None else w.float())


def _fall_back(bases: dict, diagonals: dict, held) -> list[str]:
    """Replace, in place, every block whose basis codes the held-out KV less accurately than
    per-channel int-N of the same or fewer bytes (fallback.py) by its diagonal basis; the names ("g<i>.<k|v>") of those blocks. held: per held-out KV,
    a function (group, kind index) -> its samples."""
    from kvcodec.transform.fallback import falls_back, levels

    thetas = levels(torch.cat([bases[key].variances for key in sorted(bases)]))
    fell = []
    for gi, kind in sorted(bases):
        samples = torch.cat([h(gi, KINDS.index(kind)) for h in held])
        if falls_back(bases[(gi, kind)], samples, thetas):
            bases[(gi, kind)] = diagonals[(gi, kind)]
            fell.append(f"g{gi}.{kind}")
    return fell


def fit_group(x: torch.Tensor, w: torch.Tensor | None, covariance: str = "sample") -> GroupBasis:
    """The (weighted) KLT of samples x (n, d): PCA of sqrt(w) x, basis scaled back by 1/sqrt(w)."""
    if w is None:
        mean, basis, var = fit_pca(x, covariance)
        return GroupBasis(mean.float(), basis.float(), var.float())
    sw = w.sqrt()
    mean, basis, var = fit_pca(x.to(torch.float64) * sw, covariance)
    return GroupBasis((mean / sw).float(), (basis / sw[:, None]).float(), var.float(), w.float())


def all_variances(cal: Calibration) -> torch.Tensor:
    """Every coordinate's calibration variance, groups in order, K before V within a group."""
    return torch.cat([cal.basis(g, k).variances for g in range(len(cal.groups)) for k in KINDS])
