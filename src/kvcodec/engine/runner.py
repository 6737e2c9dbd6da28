"""Model execution: chunked prefill (on top of a restored prefix), one-token decode steps, sampling.

Each request keeps its own transformers DynamicCache over reserved storage (room for its prompt
and answer; a restored prefix's storage is the fetch's target), into which every forward writes
its new tokens in place (integrations.hf.reserved_cache). A prompt is prefilled in pieces
(`prefill_chunk`): while other requests decode, at most `prefill_chunk_tokens` per engine iteration,
so a long prompt never holds the running batch for its whole prefill; alone, in one forward up to
`max_prefill_tokens` (a later piece attends through a dense mask, slower than one causal forward). A decode iteration either runs one forward for the whole
running batch (`decode_batched`: the caches are left-padded to the longest one into a temporary
batched cache, with an attention mask and explicit positions; each request's new K/V is then
appended to its own cache) or one forward per request (`decode`). No paged attention: the batched
step copies the running caches once per iteration, simple rather than fast. Every transformers
detail goes through kvcodec.integrations.hf.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from kvcodec.engine.sequence import Request, SamplingParams
from kvcodec.integrations.hf import cache_kwarg, layer_pairs, make_cache, output_cache, reserved_cache
from kvcodec.models.check import keeps_recurrent_state
from kvcodec.models.registry import kv_shape

log = logging.getLogger(__name__)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


RESERVE_NEW_TOKENS = 512  # room for output tokens reserved up front; a longer answer grows the cache


def cache_capacity(req: Request) -> int:
    """Tokens of cache storage reserved for a request: its prompt and (up to a bound) its answer."""
    return req.prompt_len + min(req.params.max_new_tokens, RESERVE_NEW_TOKENS)


def restore_target(layers: int, tokens: int, kv_heads: int, head_dim: int, device: Any, dtype: Any) -> torch.Tensor:
    """An uninitialized canonical (L, 2, T, H, D) view whose storage is laid out as the model's
    cache ([L, 2, H, T, D]): restored values go straight where attention reads them."""
    storage = torch.empty(layers, 2, kv_heads, tokens, head_dim, device=device, dtype=dtype)
    return storage.permute(0, 1, 3, 2, 4)


def layer_storage(kv: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Per-layer ([1, H, T, D] keys, values) views of a canonical (L, 2, T, H, D) tensor laid out
    as restore_target lays it out (each head's tokens contiguous); None for any other layout."""
    st = kv.permute(0, 1, 3, 2, 4)  # (L, 2, H, T, D)
    if st.stride(-1) != 1 or st.stride(-2) != st.shape[-1] or st.stride(-3) != st.shape[-1] * st.shape[-2]:
        return None
    return [(st[i, 0][None], st[i, 1][None]) for i in range(st.shape[0])]


def sdpa_context(backends: tuple[str, ...] | None) -> Any:
    """A factory of contexts that restrict torch's attention kernels to `backends` (names of
    EngineConfig.SDPA_BACKENDS); None: no restriction."""
    if backends is None:
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }
    chosen = [names[b] for b in backends]
    return lambda: sdpa_kernel(chosen)


def holds_kv_pairs(model: Any) -> bool:
    """Whether the model's cache is keys and values in every layer, of a shape kvcodec can tell (not a
    recurrent state: Mamba and its hybrids)."""
    config = getattr(model, "config", None)
    try:
        kv_shape(model)
    except Exception:  # noqa: BLE001 - any config kvcodec cannot read a KV shape from (transformers' per-layer ones raise theirs)
        return False
    return config is not None and not keeps_recurrent_state(config)


class ModelRunner:
    """Runs a Hugging Face causal LM for the engine."""

    def __init__(
        self, model: Any, device: torch.device | str | None = None, sdpa_backends: tuple[str, ...] | None = None
    ) -> None:
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(self.device).eval()
        self.dtype = next(model.parameters()).dtype
        self.cache_kw = cache_kwarg(self.model)
        self.attention = sdpa_context(sdpa_backends)
        self.layout: Any = None  # kvspec.serving.GroupedLayout for models with several KV layer groups
        config = getattr(self.model, "config", None)
        self.vocab_size = int(getattr(config, "vocab_size", 0) or 0) or None
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        self.batchable = holds_kv_pairs(self.model)  # decode_batched pads and joins each layer's keys and values

    def forward(self, ids: torch.Tensor, cache: Any, **kw: Any) -> tuple[torch.Tensor, Any]:
        """(logits, cache) of one forward; cache None starts a new one."""
        if cache is not None:
            kw[self.cache_kw] = cache
        with self.attention():
            out = self.model(input_ids=ids, use_cache=True, **kw)
        return out.logits, output_cache(out)

    def begin_prefill(self, req: Request) -> None:
        """Start req.cache from its restored prefix (if any), cut to at most prompt_len - 1 tokens:
        the last prompt token always goes through the model, since its logits give the first
        output token. The cache works in the restored tensor's own storage when the fetch
        restored into a restore_target on this device in this dtype (no copy)."""
        start = 0
        req.cache = None
        if req.restored_kv is not None and req.restored_tokens > 0:
            start = min(req.restored_tokens, req.prompt_len - 1)
            if self.layout is not None:
                req.cache = self.layout.restored_cache(req.restored_kv, start)
            else:
                req.cache = self._restored_cache(req.restored_kv, start, cache_capacity(req))
        elif self.layout is not None:
            req.cache = self.layout.new_cache()
        else:
            req.cache = self._empty_cache(cache_capacity(req))
        req.restored_kv = None  # the cache holds (views of) the data now
        req.restored_tokens = req.prefill_pos = start
        req.prefilled_tokens = req.prompt_len - start

    def _restored_cache(self, kv: torch.Tensor, start: int, capacity: int) -> Any:
        storage = layer_storage(kv) if kv.device == self.device and kv.dtype == self.dtype else None
        if storage is None:  # restored elsewhere (another device, dtype or layout): one copy
            target = restore_target(kv.shape[0], capacity, kv.shape[3], kv.shape[4], self.device, self.dtype)
            target[:, :, :start].copy_(kv[:, :, :start])
            storage = layer_storage(target)
        return reserved_cache(storage, start, self.model.config)

    def _empty_cache(self, capacity: int) -> Any:
        """A cache with room for `capacity` tokens; None (the model makes its own) for caches
        whose shape kvcodec cannot tell, or that hold more than keys and values (holds_kv_pairs)."""
        if not self.batchable:
            return None
        layers, kv_heads, head_dim = kv_shape(self.model)
        target = restore_target(layers, capacity, kv_heads, head_dim, self.device, self.dtype)
        return reserved_cache(layer_storage(target), 0, self.model.config)

    @torch.inference_mode()
    def prefill_chunk(self, req: Request, max_tokens: int) -> torch.Tensor | None:
        """Run the next at most `max_tokens` prompt tokens; the last token's logits once the whole
        prompt is in the cache, else None."""
        end = min(req.prompt_len, req.prefill_pos + max(1, max_tokens))
        ids = torch.tensor([req.prompt_ids[req.prefill_pos : end]], dtype=torch.long, device=self.device)
        logits, req.cache = self.forward(ids, req.cache, logits_to_keep=1)
        req.prefill_pos = end
        return logits[0, -1] if end == req.prompt_len else None

    @torch.inference_mode()
    def decode(self, reqs: list[Request]) -> list[torch.Tensor]:
        """One decode step for each request (its last output token in, next-token logits out)."""
        logits = []
        for req in reqs:
            ids = torch.tensor([[req.output_ids[-1]]], dtype=torch.long, device=self.device)
            out, req.cache = self.forward(ids, req.cache)
            logits.append(out[0, -1])
        return logits

    @torch.inference_mode()
    def decode_batched(self, reqs: list[Request]) -> list[torch.Tensor]:
        """One decode step for all requests in a single forward (left-padded batch)."""
        if len(reqs) <= 1:
            return self.decode(reqs)
        lens = [r.cache.get_seq_length() for r in reqs]
        longest = max(lens)
        per_req = [layer_pairs(r.cache) for r in reqs]
        data = []
        for i in range(len(per_req[0])):
            ks, vs = [], []
            for pairs, n in zip(per_req, lens):
                k, v = pairs[i]  # [1, kv_heads, n, head_dim]
                if n < longest:
                    pad = k.new_zeros(1, k.shape[1], longest - n, k.shape[3])
                    k, v = torch.cat([pad, k], 2), torch.cat([pad, v], 2)
                ks.append(k)
                vs.append(v)
            data.append((torch.cat(ks), torch.cat(vs)))
        cache = make_cache(data, self.model.config)
        mask = torch.zeros(len(reqs), longest + 1, dtype=torch.long, device=self.device)
        for b, n in enumerate(lens):
            mask[b, longest - n :] = 1
        pos = torch.tensor([[n] for n in lens], dtype=torch.long, device=self.device)
        ids = torch.tensor([[r.output_ids[-1]] for r in reqs], dtype=torch.long, device=self.device)
        logits, new = self.forward(ids, cache, attention_mask=mask, position_ids=pos)
        before = [_layer_lengths(r.cache) for r in reqs]
        try:
            for b, r in enumerate(reqs):
                for i, (k, v) in enumerate(layer_pairs(new)):
                    r.cache.update(k[b : b + 1, :, -1:], v[b : b + 1, :, -1:], i)
        except Exception as e:  # the one-by-one decode that follows must append each request's position once
            broken = _cut_back(reqs, before)
            if broken:
                raise BatchedAppendError(broken) from e
            raise
        return [logits[b, -1] for b in range(len(reqs))]


class BatchedAppendError(RuntimeError):
    """A batched decode step failed while appending its new positions; `broken`: the requests whose caches
    could not be put back as they were (they cannot go on), the others' caches are as before the step."""

    def __init__(self, broken: list[Request]) -> None:
        super().__init__(f"a batched decode step left {len(broken)} request caches it could not put back")
        self.broken = broken


def _layer_lengths(cache: Any) -> list[int] | None:
    """Each layer's length in tokens (None: a cache without per-layer access)."""
    layers = getattr(cache, "layers", None)
    return None if layers is None else [layer.get_seq_length() for layer in layers]


def _cut_back(reqs: list[Request], before: list[list[int] | None]) -> list[Request]:
    """Each request's cache layers back to their lengths `before` a batched step appended to some of
    them; the requests where that cannot be done (a layer that cannot drop tokens, no per-layer access)."""
    broken = []
    for r, lengths in zip(reqs, before):
        now = _layer_lengths(r.cache)
        if lengths is not None and now == lengths:
            continue
        try:
            if lengths is None or now is None or len(now) != len(lengths):
                raise ValueError("no per-layer access")
            for layer, n, m in zip(r.cache.layers, lengths, now):
                if m > n:
                    layer.crop(n - m)  # negative: the tokens to drop
            if _layer_lengths(r.cache) != lengths:
                raise ValueError("its layers did not drop the appended position")
        except Exception as e:  # noqa: BLE001 - the request cannot go on; the others can
            log.warning("a request's cache cannot be put back after a failed batched decode: %s", e)
            broken.append(r)
    return broken


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """Greedy for temperature 0; otherwise temperature/top-p sampling with the request's generator."""
    if params.temperature <= 0:
        return int(torch.argmax(logits).item())
    scores = logits.double()  # a temperature below float32's range (1e-50) is 0 there: 0 / 0 at the maximum
    probs = torch.softmax((scores - scores.max()) / params.temperature, dim=-1)  # max first: no inf / inf at tiny T
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < params.top_p
        keep[0] = True  # the likeliest token always: a top_p below float32's least value compares as 0
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    gen_device = generator.device if generator is not None else probs.device
    return int(torch.multinomial(probs.to(gen_device), 1, generator=generator).item())
