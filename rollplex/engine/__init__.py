"""The paged-KV decode engine (Rollplex's rollout)."""

from rollplex.engine.engine import Engine, EngineConfig
from rollplex.engine.nonfinite import NonFiniteLogitsError
from rollplex.engine.sampler import SamplingParams
from rollplex.engine.sequence import Request

__all__ = ["Engine", "EngineConfig", "NonFiniteLogitsError", "Request", "SamplingParams"]
