"""A small inference engine on Hugging Face transformers with fetch-aware remote prefix reuse."""

from kvcodec.engine.engine import Engine
from kvcodec.engine.metrics import EngineMetrics
from kvcodec.engine.sequence import Request, RequestOutput, SamplingParams, State
from kvcodec.engine.storer import StorePolicy

__all__ = ["Engine", "EngineMetrics", "Request", "RequestOutput", "SamplingParams", "State", "StorePolicy"]
