"""Model execution: prefill (on top of a restored prefix) and one-token decode steps, and sampling.

Each request keeps its own transformers DynamicCache. A decode iteration runs one forward per
running request (no padding, no paged attention): simple and exact, at the cost of batching
efficiency. The canonical KV tensor `(layers, 2, tokens, kv_heads, head_dim)` crosses into and out
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
