"""The native paged-attention engine (nano-vllm style): see llm_engine.LLMEngine."""

from sluice.worker.engine.config import EngineConfig
from sluice.worker.engine.outputs import RequestOutput, TokenLogprob
from sluice.worker.engine.sampling_params import SamplingParams

__all__ = ["EngineConfig", "RequestOutput", "SamplingParams", "TokenLogprob"]
