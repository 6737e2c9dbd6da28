"""kvbench: kvcodec's benchmarks, its baseline codec zoo and emulated network links.

Kept outside the installed `kvcodec` package: `pip install -e benchmarks` (scripts/install.sh does)
gives `python -m kvbench <name>`, the `kvcodec-bench` script and `kvcodec bench <name>`.

- kvbench.cli: the click group of every benchmark (ratio, decode, fetch, ttft, interference,
  accuracy, baselines, plot);
- kvbench.results: where results go and the one writer of result files (JSON + markdown + machine);
- kvbench.baselines: raw, zstd, lz4, nvCOMP, CacheGen-style as ChunkCodecs, registered by name;
- kvbench.net: shaped links (netns + tc, an in-process token bucket) and a redis-server launcher.
"""
