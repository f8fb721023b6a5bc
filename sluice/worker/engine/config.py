"""Engine configuration. Only the engine and scheduler read it; lower layers take numbers."""

from __future__ import annotations

from dataclasses import dataclass


DEFAULT_MAX_MODEL_LEN = 8192  # the context a worker serves: the model's, capped at this

QUANTIZATIONS = ("int8", "int4")  # weight-only (quant.py)


@dataclass
class EngineConfig:
    """Options of the native engine (worker flags map 1:1 onto these).

    Attributes:
        model: path of a converted model folder (config.json + *.safetensors + tokenizer).
        served_model_name: the name the API serves; defaults to the folder name.
        max_model_len: context length in tokens (prompt + output); default: the model's
            ``max_position_embeddings`` capped at 8192.
        block_size: tokens per KV-cache block.
        kv_cache_gib: memory budget of the KV block pool, GiB.
        max_num_seqs: most sequences in one step's batch.
        max_num_batched_tokens: per-step token budget (prefill + decode tokens).
        long_prefill_token_threshold: the most tokens of one sequence's prefill per step
            (vLLM's name), counted at an empty context: the scheduler shrinks a chunk as
            the context it attends over grows, so every chunk costs about the same;
            default a sixteenth of max_num_batched_tokens (128 tokens: a step of about
            0.2 s for SmolLM2-135M on two CPU cores, short enough that a long prompt
            keeps other requests' p99 TTFT within 3x; bench/chunked_prefill.py).
        enable_prefix_caching: reuse the KV blocks of a shared prompt prefix across requests.
        quantization: None, "int8" for per-output-channel int8 weight-only linears, or
            "int4" for the decoder layers' linears in 4-bit Q4_1 blocks (lm_head int8).
        speculative_method: None; "ngram" for prompt-lookup speculative decoding; "draft"
            for a smaller draft model sharing the tokenizer (``speculative_model``).
        num_speculative_tokens: k, the most draft tokens verified per step.
        speculative_model: converted folder of the draft model (method "draft").
        speculative_model_quantization: None, "int8" or "int4" for the draft model.
        max_sequences_per_request: the most engine requests one API request may fan out
            into (prompts × n); the server answers 400 beyond. Default 2048: OpenAI's own
            caps (n <= 128, 2,048 prompts) multiply to 262,144 sequences, which would hold a
            worker for minutes; the scheduler shares the batch fairly between requests
            either way (scheduler.py).
        dtype: "float32" (fast on CPUs without bf16 units) or "bfloat16"/"float16".
        device: "cpu" or "cuda".

    Raises:
        ValueError: from ``__post_init__`` when a value is out of range.
    """

    model: str
    served_model_name: str | None = None
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_gib: float = 0.5
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int | None = None
    enable_prefix_caching: bool = True
    quantization: str | None = None
    speculative_method: str | None = None
    num_speculative_tokens: int = 4
    speculative_model: str | None = None
    speculative_model_quantization: str | None = None
    max_sequences_per_request: int = 2048
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold is None:
            self.long_prefill_token_threshold = max(1, self.max_num_batched_tokens // 16)
        if self.long_prefill_token_threshold < 1:
            raise ValueError("long_prefill_token_threshold must be >= 1, "
                             f"got {self.long_prefill_token_threshold}")
        for name in ("quantization", "speculative_model_quantization"):
            if getattr(self, name) not in (None, *QUANTIZATIONS):
                raise ValueError(f"{name} must be int8, int4 or unset, "
                                 f"got {getattr(self, name)!r}")
        if self.speculative_method not in (None, "ngram", "draft"):
            raise ValueError("speculative_method must be ngram, draft or unset, "
                             f"got {self.speculative_method!r}")
        if (self.speculative_method == "draft") != (self.speculative_model is not None):
            raise ValueError("speculative_model is needed by, and only by, speculative_method draft")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.max_sequences_per_request < 1:
            raise ValueError("max_sequences_per_request must be >= 1, "
                             f"got {self.max_sequences_per_request}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
