"""Models and KV for timing runs: full-size architectures with random weights (timing only, never
KV statistics) and real small-model KV tiled into their shapes."""

from __future__ import annotations

# name -> (transformers config class, its arguments, the real small model of the same family whose KV
# stands in for this architecture's)
LARGE = {
    # name: (transformers config class, kwargs, KV-statistics source model)
    "llama3-8b": (
        "LlamaConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            rope_theta=500000.0,
            max_position_embeddings=131072,
        ),
        "smollm2-135m",
    ),
    "qwen2.5-7b": (
        "Qwen2Config",
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
        ),
        "qwen2.5-coder-0.5b",
    ),
    # small stand-in for smoke tests of the random-weight paths on a CPU
    "llama-tiny": (
        "LlamaConfig",
        dict(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=32000,
            max_position_embeddings=4096,
        ),
        "smollm2-135m",
    ),
}


def build_model(target: str, device: str):  # noqa: ANN201
    """(model, kv fp16 bytes per token, is_random_weights)."""
    import torch

    if target in LARGE:
        import transformers

        cls, kw, _ = LARGE[target]
        cfg = getattr(transformers, cls)(**kw)
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        random = True
    else:
        from kvcodec.models import load_model

        model, _ = load_model(target)
        model = model.to(device)
        random = False
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 2
    return model.eval(), per_token, random


def tiled_kv(real, layers: int, heads: int, head_dim: int, tokens: int):  # noqa: ANN001, ANN201
    """A KV tensor of a larger shape filled with REAL values of a small model's KV `real`
    (L0, 2, T0, H0, D0): out[l, k, t, h, d] = real[l % L0, k, (t + shift) % T0, (h + d // D0) % H0, d % D0]
    with a token shift per (layer, head, dim block) copy, so that no two channels are identical. Used where the model
    itself has random weights (timing runs): random-weight KV would not compress like real KV."""
    import torch

    L0, _, T0, H0, D0 = real.shape
    out = torch.empty((layers, 2, tokens, heads, head_dim), dtype=real.dtype)
    for l in range(layers):
        for h in range(heads):
            for b in range(0, head_dim, D0):
                w = min(D0, head_dim - b)
                shift = (97 * h + 13 * l + 31 * (b // D0)) % T0
                ti = (torch.arange(tokens) + shift) % T0
                out[l, :, :, h, b : b + w] = real[l % L0][:, ti][:, :, (h + b // D0) % H0, :w]
    return out


def model_tag(model: str) -> str:
    """A file-name-safe name of `model` for caches of its prefilled KV: a registered name as it is; a
    model directory or file by its name and a fingerprint of its files (path, names, sizes, times),
    so a model saved again under the same path is not served the old one's KV."""
    import hashlib
    from pathlib import Path

    from kvcodec.models.local import is_local

    if not is_local(model):
        return model
    path = Path(model).expanduser().resolve()
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    h = hashlib.sha256(str(path).encode())
    for f in files:
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return f"{path.name}-{h.hexdigest()[:16]}"


def text_tag(text: str) -> str:
    """A file-name-safe name of a text for caches of its prefilled KV: a text name with its slashes
    replaced; a file of the user's (kvcodec.models.texts.load_text takes one) by its name and its
    contents' hash, so an edited file, or another of the same name, is not served the old one's KV."""
    import hashlib

    from kvcodec.models.texts import text_file

    path = text_file(text)
    if path is None:
        return text.replace("/", "_")
    return f"{path.name[:64]}-{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"
