"""The native paged-attention engine (nano-vllm style): see llm_engine.LLMEngine. What both
engines share (``SamplingParams``, ``RequestOutput``) lives beside them in ``sluice.worker``."""

from sluice.worker.engine.config import EngineConfig

__all__ = ["EngineConfig"]
