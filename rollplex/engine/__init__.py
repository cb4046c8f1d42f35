"""The paged-KV decode engine (Rollplex's rollout)."""

from rollplex.engine.engine import Engine, EngineConfig
from rollplex.engine.sampler import SamplingParams
from rollplex.engine.sequence import Request, RequestOutput, Sample

__all__ = ["Engine", "EngineConfig", "Request", "RequestOutput", "Sample", "SamplingParams"]
