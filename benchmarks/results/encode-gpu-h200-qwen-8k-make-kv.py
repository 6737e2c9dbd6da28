"""Real KV of 512 tokens tiled to N tokens: RoPE taken off the keys, the tokens repeated, RoPE
put back at the new positions (so every position's keys are rotated as a model would)."""
import sys
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from kvcodec.transform.kvt import load_kvt
from kvcodec.transform.rope import apply_rope, remove_rope

src, kvt, n, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
with safe_open(src, "pt") as f:
    kv, meta = f.get_tensor("kv").float(), f.metadata()
rope = load_kvt(kvt)[0].rope
t = kv.shape[2]
kv[:, 0] = remove_rope(kv[:, 0], torch.arange(t), rope)
kv = kv.repeat(1, 1, -(-n // t), 1, 1)[:, :, :n].contiguous()
kv[:, 0] = apply_rope(kv[:, 0], torch.arange(n), rope)
meta = {"model": meta["model"], "text": f"{meta['text']} (first {t} tokens, tiled, RoPE at the new positions)", "tokens": str(n), "dtype": "float16"}
save_file({"kv": kv.half()}, out, metadata=meta)
print("made", out, tuple(kv.shape))
