"""Diagonal Fisher information of a model's next-token distribution with respect to a prefix's
KV: E_y[(d log p(y) / d kv)^2], y sampled from the model itself, over a short continuation that
follows the prefix. Second order, the expected KL divergence a KV error e causes is
0.5 sum_c F_c e_c^2: F says which channels the model feels (weights.py turns it into weights)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvcodec.errors import ConfigError


def fisher_diagonal(
    model: Any,
    sequences: Sequence[torch.Tensor],
    prefix_tokens: int,
    *,
    samples: int = 2,
    sink_tokens: int = 4,
    seed: int = 0,
    prefix_kvs: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Token-averaged diagonal Fisher (layers, 2, heads, dim) float32 over `sequences` (token ids,
    each longer than prefix_tokens): the prefix's KV is computed (or taken from prefix_kvs, one
    canonical (layers, 2, prefix_tokens, heads, dim) KV per sequence, when the caller has it), then
    the rest of the sequence runs on it; `samples` draws of the model's own next tokens per sequence.
    The first sink_tokens positions (kept exactly by the codec) are left out of the average."""
    from kvcodec.integrations.hf import cache_kwarg, cache_to_tensor, forward_ids, tensor_to_cache

    if prefix_tokens <= sink_tokens:
        raise ConfigError(f"the prefix ({prefix_tokens} tokens) must be longer than the {sink_tokens} sink tokens")
    gen = torch.Generator().manual_seed(seed)
    total, count = None, 0
    if prefix_kvs is not None and len(prefix_kvs) != len(sequences):
        raise ConfigError(f"{len(prefix_kvs)} prefix KVs for {len(sequences)} sensitivity texts")
    for i, ids in enumerate(sequences):
        if ids.numel() < prefix_tokens + 2:
            raise ConfigError(f"a sensitivity text has {ids.numel()} tokens; needs more than {prefix_tokens + 1}")
        if prefix_kvs is None:
            kv0 = cache_to_tensor(forward_ids(model, ids[:prefix_tokens])[1]).to(model.dtype)
        elif prefix_kvs[i].shape[2] != prefix_tokens:
            raise ConfigError(f"prefix KV {i} holds {prefix_kvs[i].shape[2]} positions, not {prefix_tokens}")
        else:
            kv0 = prefix_kvs[i].to(device=next(model.parameters()).device, dtype=model.dtype)
        cont = ids[prefix_tokens:].to(model.device).unsqueeze(0)
        for _ in range(samples):
            kv = kv0.clone().requires_grad_(True)
            logits = model(cont, use_cache=True, **{cache_kwarg(model): tensor_to_cache(kv, model)}).logits[0]
            logp = torch.log_softmax(logits.float(), -1)
            y = torch.multinomial(logp.detach().exp().cpu(), 1, generator=gen).to(logp.device)
            (grad,) = torch.autograd.grad(-logp.gather(1, y).sum(), kv)
            g2 = grad[:, :, sink_tokens:].to(torch.float64).pow(2).mean(2).cpu()
            total = g2 if total is None else total + g2
            count += 1
    if total is None:
        raise ConfigError("sensitivity needs at least one text")
    return (total / count).float()
