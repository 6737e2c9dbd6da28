"""Model execution: prefill (on top of a restored prefix) and one-token decode steps, and sampling.

Each request keeps its own transformers DynamicCache. A decode iteration either runs one forward
for the whole running batch (`decode_batched`: the caches are left-padded to the longest one into a
temporary batched cache, with an attention mask and explicit positions; each request's new K/V is
then appended to its own cache) or one forward per request (`decode`). No paged attention: the
batched step copies the running caches once per iteration, simple rather than fast. The canonical KV tensor `(layers, 2, tokens, kv_heads, head_dim)` crosses into and out
of the model through kvcodec.integrations.hf.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcodec.engine.sequence import Request, SamplingParams


# ---- transformers 4.x / 5.x differences (the GPU machine runs 4.x) --------------------------------
def cache_kwarg(model: Any) -> str:
    """Name of forward()'s cache argument: "cache" (transformers 5) or "past_key_values" (4.x)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def output_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def layer_pairs(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, each [batch, kv_heads, seq, head_dim], whatever the cache layout."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache))  # transformers < 4.56


def make_cache(pairs: list[tuple[torch.Tensor, torch.Tensor]], config: Any) -> Any:
    """A DynamicCache holding `pairs` (no copy where the transformers release allows)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(ddp_cache_data=pairs, config=config)
    except TypeError:
        return DynamicCache.from_legacy_cache(tuple(pairs))


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ModelRunner:
    """Runs a Hugging Face causal LM for the engine."""

    def __init__(self, model: Any, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(self.device).eval()
        self.dtype = next(model.parameters()).dtype
        self.cache_kw = cache_kwarg(self.model)

    def forward(self, ids: torch.Tensor, cache: Any, **kw: Any) -> tuple[torch.Tensor, Any]:
        """(logits, cache) of one forward; cache None starts a new one."""
        if cache is not None:
            kw[self.cache_kw] = cache
        out = self.model(input_ids=ids, use_cache=True, **kw)
        return out.logits, output_cache(out)

    @torch.inference_mode()
    def prefill(self, req: Request) -> torch.Tensor:
        """Fill req.cache with the prompt's KV (restored part + computed part); last-token logits.

        A restored prefix is cut to at most prompt_len - 1 tokens: the last prompt token always goes
        through the model, since its logits give the first output token.
        """
        start = 0
        cache = None
        if req.restored_kv is not None and req.restored_tokens > 0:
            from kvcodec.integrations.hf import tensor_to_cache

            start = min(req.restored_tokens, req.prompt_len - 1)
            kv = req.restored_kv[:, :, :start].to(device=self.device, dtype=self.dtype)
            cache = tensor_to_cache(kv, self.model)
        req.restored_kv = None  # free it: the cache owns the data now
        if cache is None:
            start = 0
        ids = torch.tensor([req.prompt_ids[start:]], dtype=torch.long, device=self.device)
        logits, req.cache = self.forward(ids, cache, logits_to_keep=1)
        req.restored_tokens = start
        req.prefilled_tokens = req.prompt_len - start
        return logits[0, -1]

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
        for b, r in enumerate(reqs):
            for i, (k, v) in enumerate(layer_pairs(new)):
                r.cache.update(k[b : b + 1, :, -1:], v[b : b + 1, :, -1:], i)
        return [logits[b, -1] for b in range(len(reqs))]


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """Greedy for temperature 0; otherwise temperature/top-p sampling with the request's generator."""
    if params.temperature <= 0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < params.top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    gen_device = generator.device if generator is not None else probs.device
    return int(torch.multinomial(probs.to(gen_device), 1, generator=generator).item())
