"""One model replica: the continuous-batching engine and the Serve deployment that hosts it."""

from replicas.config import EngineConfig
from replicas.engine import CompletionOutput, Engine, EngineLoad, RequestOutput
from replicas.request import RequestStatus, SamplingParams

__all__ = ["CompletionOutput", "Engine", "EngineConfig", "EngineLoad", "RequestOutput",
           "RequestStatus", "SamplingParams"]
