"""Adapters between kvcodec's canonical KV tensor and serving frameworks' caches."""
