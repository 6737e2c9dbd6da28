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


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ModelRunner:
    """Runs a Hugging Face causal LM for the engine."""

    def __init__(self, model: Any, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(self.device).eval()
        self.dtype = next(model.parameters()).dtype

    def empty_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

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
            cache = self.empty_cache()
        ids = torch.tensor([req.prompt_ids[start:]], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        req.cache = out.cache
        req.restored_tokens = start
        req.prefilled_tokens = req.prompt_len - start
        return out.logits[0, -1]

    @torch.inference_mode()
    def decode(self, reqs: list[Request]) -> list[torch.Tensor]:
        """One decode step for each request (its last output token in, next-token logits out)."""
        logits = []
        for req in reqs:
            ids = torch.tensor([[req.output_ids[-1]]], dtype=torch.long, device=self.device)
            out = self.model(input_ids=ids, cache=req.cache, use_cache=True)
            req.cache = out.cache
            logits.append(out.logits[0, -1])
        return logits


    @torch.inference_mode()
    def decode_batched(self, reqs: list[Request]) -> list[torch.Tensor]:
        """One decode step for all requests in a single forward (left-padded batch)."""
        if len(reqs) <= 1:
            return self.decode(reqs)
        from transformers import DynamicCache

        lens = [r.cache.get_seq_length() for r in reqs]
        longest = max(lens)
        data = []
        for i in range(len(reqs[0].cache.layers)):
            ks, vs = [], []
            for r, n in zip(reqs, lens):
                k, v = r.cache.layers[i].keys, r.cache.layers[i].values  # [1, kv_heads, n, head_dim]
                if n < longest:
                    pad = k.new_zeros(1, k.shape[1], longest - n, k.shape[3])
                    k, v = torch.cat([pad, k], 2), torch.cat([pad, v], 2)
                ks.append(k)
                vs.append(v)
            data.append((torch.cat(ks), torch.cat(vs)))
        cache = DynamicCache(ddp_cache_data=data, config=self.model.config)
        mask = torch.zeros(len(reqs), longest + 1, dtype=torch.long, device=self.device)
        for b, n in enumerate(lens):
            mask[b, longest - n :] = 1
        pos = torch.tensor([[n] for n in lens], dtype=torch.long, device=self.device)
        ids = torch.tensor([[r.output_ids[-1]] for r in reqs], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
        new = out.cache
        for b, r in enumerate(reqs):
            for i, layer in enumerate(new.layers):
                r.cache.update(layer.keys[b : b + 1, :, -1:], layer.values[b : b + 1, :, -1:], i)
        return [out.logits[b, -1] for b in range(len(reqs))]


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
