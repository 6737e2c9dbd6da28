"""A small inference engine on Hugging Face transformers with fetch-aware remote prefix reuse."""

from kvcodec.engine.config import EngineConfig
from kvcodec.engine.engine import Engine
from kvcodec.engine.metrics import EngineMetrics
from kvcodec.engine.scheduler import POLICIES, PrefixSource, Scheduler
from kvcodec.engine.sequence import Request, RequestOutput, SamplingParams, State
from kvcodec.engine.storer import StorePolicy

__all__ = [
    "POLICIES",
    "Engine",
    "EngineConfig",
    "EngineMetrics",
    "PrefixSource",
    "Request",
    "RequestOutput",
    "SamplingParams",
    "Scheduler",
    "State",
    "StorePolicy",
]
