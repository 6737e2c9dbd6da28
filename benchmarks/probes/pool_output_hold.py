"""Probe: how long an NVDEC pool worker keeps the consumer's output tensor (CUDA IPC) allocated.

    python benchmarks/probes/pool_output_hold.py      # on a CUDA machine with PyNvVideoCodec

Restores a small KV into a 64 MB tensor through a 2-worker pool, drops the tensor, and prints how
much of the consumer's CUDA memory is still allocated after 0, 0.5 and 1 s, for a long
hold_output_s (5 s, standing in for the old "until the next job") and for the default (50 ms).
"""

import time

import torch

import kvcodec
from kvcodec.codecs.hevc.pool import decode_parallel
from kvcodec.config import CodecConfig
from kvcodec.video.nvdec_pool import NvdecPool


def main() -> None:
    g = torch.Generator().manual_seed(5)
    kv = (torch.randn(2, 2, 128, 2, 64, generator=g) * 0.7).to(torch.float16)
    data = kvcodec.encode(kv, CodecConfig(quant="int8", chunk_tokens=32, resolutions=((256, 256),)))
    for hold in (5.0, 0.05):
        with NvdecPool(workers=2, slots=2, max_frame=(256, 256), hold_output_s=hold) as pool:
            decode_parallel(data, pool)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            out = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
            view = out[: kv.numel() * 2].view(torch.float16).view(kv.shape)
            decode_parallel(data, pool, out=view)
            del out, view
            for t in (0.0, 0.5, 1.0):
                time.sleep(0.5 if t else 0)
                torch.cuda.ipc_collect()
                extra = (torch.cuda.memory_allocated() - before) / 1e6
                print(f"hold {hold} after {t} s: extra MB {extra:.1f}", flush=True)


if __name__ == "__main__":
    main()
