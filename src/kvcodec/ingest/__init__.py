"""Bulk ingest: prefill a corpus with a model and store every document's prefix KV (`kvcodec ingest`)."""

from kvcodec.ingest.run import DocResult, IngestReport, ingest
from kvcodec.ingest.sources import Document, read_documents

__all__ = ["DocResult", "Document", "IngestReport", "ingest", "read_documents"]
