"""LLMEngine: the synchronous core. ``step()`` = schedule → run the model → sample → outputs."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerFast

from sluice.worker.engine.config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from sluice.worker.engine.detokenizer import IncrementalDetokenizer
from sluice.worker.engine.model_runner import ModelRunner
from sluice.worker.engine.models.llama import SUPPORTED_ARCHITECTURES
from sluice.worker.engine.sampler import logprobs_of, penalize, sample
from sluice.worker.engine.scheduler import Scheduler
from sluice.worker.engine.sequence import Sequence, SequenceStatus
from sluice.worker.engine.spec_decode import DraftModelProposer, NgramProposer, verify
from sluice.worker.outputs import RequestOutput
from sluice.worker.sampling_params import SamplingParams, check_fits

logger = logging.getLogger(__name__)



class LLMEngine:
    """Continuous-batching engine over a paged KV cache (nano-vllm / vLLM v1 design).

    Args:
        config: engine options; ``config.model`` is a converted model folder.

    Attributes:
        tokenizer: the HF tokenizer of the model.
        max_model_len: context length in tokens.
        model_name: the served model name.
        eos_token_ids: ids that end generation unless ``ignore_eos``.

    Raises:
        ValueError: the folder holds an unsupported architecture, or the options do not fit.
    """

    def __init__(self, config: EngineConfig):
        model_dir = Path(config.model)
        hf_config = load_config(model_dir)
        archs = getattr(hf_config, "architectures", None) or []
        if not set(archs) & set(SUPPORTED_ARCHITECTURES):
            raise ValueError(f"{model_dir}: architecture {archs} is not supported by the native "
                             f"engine (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        self.tokenizer = load_tokenizer(model_dir)
        self.vocab_size = int(hf_config.vocab_size)  # the logits' width
        self.model_name = config.served_model_name or model_dir.name
        self.max_model_len = config.max_model_len or min(hf_config.max_position_embeddings,
                                                         DEFAULT_MAX_MODEL_LEN)
        self.eos_token_ids = _eos_token_ids(model_dir, self.tokenizer)
        self.runner = ModelRunner(hf_config, model_dir, self.max_model_len, config.block_size,
                                  config.dtype, config.device, config.quantization)
        draft = None
        if config.speculative_method == "draft":
            draft = _draft_runner(config, self.tokenizer, self.max_model_len)
        bytes_per_block = self.runner.bytes_per_block + (draft.bytes_per_block if draft else 0)
        num_blocks = int(config.kv_cache_gib * 2**30) // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_gib {config.kv_cache_gib} holds no KV block "
                             f"({bytes_per_block} bytes per block of {config.block_size} tokens)")
        for runner in (self.runner, draft) if draft else (self.runner,):
            runner.allocate_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB%s; %s, %d thread(s)",
                    num_blocks, config.block_size, num_blocks * config.block_size,
                    num_blocks * bytes_per_block / 2**20, " (target + draft)" if draft else "",
                    config.device, torch.get_num_threads())
        self.scheduler = Scheduler(config, num_blocks, self.runner.attention_break_even)
        self.proposer = (
            NgramProposer(config.num_speculative_tokens) if config.speculative_method == "ngram"
            else DraftModelProposer(draft, self.scheduler.block_manager, config.num_speculative_tokens)
            if draft else None)
        self.num_draft_tokens = 0  # speculative tokens proposed (cumulative)
        self.num_accepted_tokens = 0  # of those, accepted by the target
        capacity = num_blocks * config.block_size
        if capacity < self.max_model_len:  # like vLLM: one request must always fit the pool
            if config.max_model_len:
                raise ValueError(f"max_model_len {config.max_model_len} is more than the KV cache "
                                 f"holds ({capacity} tokens); raise kv_cache_gib or lower max_model_len")
            logger.warning("KV cache holds %d tokens: capping max_model_len %d to it",
                           capacity, self.max_model_len)
            self.max_model_len = capacity

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Reject a request the engine could never finish.

        Raises:
            ValueError: empty prompt, max_tokens < 1, or prompt + max_tokens over the context
                (which the KV pool always holds: see ``__init__``).
        """
        check_fits(prompt_token_ids, params, self.max_model_len, self.vocab_size)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    group: str | None = None) -> None:
        """Queue a request (validated with ``check_request`` first).

        Args:
            group: the API request it belongs to (the prompts × n of one request share
                one), for fair scheduling between requests; default: its own id.

        Raises:
            ValueError: ``check_request`` refuses it, or the id is already unfinished.
        """
        self.check_request(prompt_token_ids, params)
        detok = IncrementalDetokenizer(self.tokenizer.backend_tokenizer, prompt_token_ids, params.stop)
        self.scheduler.add(Sequence(request_id, prompt_token_ids, params, detok, group))

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Drop a request and free its blocks; returns its final output (or [] if unknown)."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return []
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return [self._output(seq)]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one iteration: propose drafts → schedule → run the model → sample or verify →
        append tokens and check stops. Returns outputs of sequences that got tokens or
        finished.

        Isolation: an error while one sequence's tokens are sampled, its drafts verified,
        its logprobs computed or its text detokenized finishes that sequence alone with
        finish_reason "error" (``RequestOutput.error`` says why) and frees its blocks; the
        rest of the batch goes on. An error in the batch as a whole (the forward pass)
        still raises.
        """
        if self.proposer is not None:
            self._propose()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        rows, samplers, prompt_rows = [], [], []
        start = 0
        for seq, n in scheduled:
            c = seq.num_computed_tokens
            if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens:
                # logits at position p score prompt token p + 1
                first = len(seq.prompt_logprobs) - 1
                last = min(c + n, seq.num_prompt_tokens - 1)
                for p in range(max(first, c), last):
                    prompt_rows.append((seq, len(rows), seq.token_ids[p + 1]))
                    rows.append(start + p - c)
            gap = seq.num_tokens - c
            if n >= gap:  # reaches the last token: logits after it and after each draft
                samplers.append((seq, len(rows)))
                rows.extend(range(start + gap - 1, start + n))
            start += n
        logits = self.runner.execute(
            [(seq.step_token_ids(n), seq.num_computed_tokens, seq.block_table) for seq, n in scheduled], rows)
        failed: dict[Sequence, BaseException] = {}
        self._record_prompt_logprobs(logits, prompt_rows, failed)
        new_tokens = self._choose_tokens(logits, samplers, failed)
        logprobs = self._token_logprobs(logits, samplers, new_tokens, failed)
        advance = {seq: n for seq, n in scheduled}
        finished = []
        for seq, _ in samplers:
            if seq in failed:
                continue
            tokens, gap = new_tokens[seq], seq.num_tokens - seq.num_computed_tokens
            try:
                for i, token in enumerate(tokens):
                    stopped_by_string = seq.append_token(
                        token, logprobs[seq][i] if seq in logprobs else None)
                    status = self._finish_status(seq, token, stopped_by_string)
                    if status is not None:
                        finished.append((seq, status))
                        break
            except Exception as exc:  # noqa: BLE001 - this sequence's detokenizer or stop rules
                failed[seq] = exc
                continue
            # computed K/V: the tokens before this step's samples plus the accepted drafts kept
            advance[seq] = gap + min(i + 1, len(tokens) - 1)
            seq.spec_token_ids = []
        self.scheduler.on_computed([(s, n) for s, n in advance.items() if s not in failed])
        for seq, status in finished:
            self.scheduler.finish(seq, status)
        for seq, exc in failed.items():
            self._fail(seq, exc)
        return [self._output(seq) for seq in dict.fromkeys([*(s for s, _ in samplers), *failed])]

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        """Finish ``seq`` alone with an error (its blocks freed); the batch goes on."""
        logger.error("request %s failed inside an engine step, the others go on: %r",
                     seq.request_id, exc, exc_info=exc)
        seq.error = f"{type(exc).__name__}: {exc}"
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)

    def _output(self, seq: Sequence) -> RequestOutput:
        """``seq``'s delta; a sequence whose detokenizer fails here fails alone."""
        if seq.status != SequenceStatus.FINISHED_ERROR:
            try:
                return seq.take_output()
            except Exception as exc:  # noqa: BLE001 - this sequence's detokenizer
                self._fail(seq, exc)
        return seq.error_output()

    def _propose(self) -> None:
        wanted = [(seq, min(seq.params.max_tokens - seq.num_output_tokens - 1,
                            self.max_model_len - seq.num_tokens))
                  for seq in self.scheduler.running
                  # decoding; a penalty scores each token after all those before it, drafts
                  # included, and the verifier scores drafts without them: no drafts for it
                  if seq.num_computed_tokens == seq.num_tokens - 1
                  and not seq.params.penalized]
        self.proposer.propose(wanted)

    def _choose_tokens(self, logits: torch.Tensor, samplers, failed) -> dict[Sequence, list[int]]:
        processed = self._logits_processors(logits, samplers)
        logits = self._penalize(processed, samplers, copy=processed is logits)
        chosen: dict[Sequence, list[int]] = {}
        plain = [(seq, row) for seq, row in samplers if not seq.spec_token_ids]
        if plain:
            rows = [row for _, row in plain]  # all of logits' rows in order: used as it is
            picked = logits if rows == list(range(len(logits))) else logits[rows]
            tokens = sample(picked, [s.params for s, _ in plain], [s.generator for s, _ in plain])
            for (seq, _), token in zip(plain, tokens):
                if isinstance(token, Exception):
                    failed[seq] = token
                else:
                    chosen[seq] = [token]
        for seq, row in samplers:
            drafts = seq.spec_token_ids
            if drafts:
                try:
                    chosen[seq] = verify(logits[row:row + len(drafts) + 1], drafts, seq.params,
                                         seq.generator)
                except Exception as exc:  # noqa: BLE001 - this sequence's parameters
                    failed[seq] = exc
                    continue
                self.num_draft_tokens += len(drafts)
                self.num_accepted_tokens += len(chosen[seq]) - 1
        return chosen

    def _logits_processors(self, logits: torch.Tensor, samplers) -> torch.Tensor:
        """``logits`` [rows, vocab] with each sequence's ``logit_bias`` added, and EOS and
        ``stop_token_ids`` at -inf in the rows that sample its output tokens 1..``min_tokens``
        (vLLM's LogitBiasLogitsProcessor and MinTokensLogitsProcessor; a copy, so logprobs
        stay the model's own). A sequence's rows are its next token's, then one per draft: a
        bias goes on all of them."""
        masks, vocab = [], logits.shape[-1]
        biased = [(seq, row) for seq, row in samplers if seq.logit_bias is not None]
        for seq, row in samplers:
            p = seq.params
            short = p.min_tokens - seq.num_output_tokens
            if short > 0:
                ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
                rows = min(short, len(seq.spec_token_ids) + 1)
                masks += [(r, t) for r in range(row, row + rows) for t in ids if t < vocab]
        if not masks and not biased:
            return logits
        processed = logits.clone()
        for seq, row in biased:  # (one indexed add a sequence: 2,048 biases cost no more)
            ids, biases = seq.logit_bias
            processed[row:row + len(seq.spec_token_ids) + 1, ids] += biases.to(logits.dtype)
        if masks:
            rows, ids = zip(*masks)
            processed[list(rows), list(ids)] = float("-inf")
        return processed

    @staticmethod
    def _penalize(logits: torch.Tensor, samplers, copy: bool) -> torch.Tensor:
        """``logits`` [rows, vocab] with each penalized sequence's row penalized
        (``sampler.penalize``), in place unless ``copy`` (the model's own logits, which
        logprobs read). A penalized sequence has no drafts (``_propose``): one row."""
        penalized = [(seq, row) for seq, row in samplers if seq.params.penalized]
        if not penalized:
            return logits
        if copy or not logits.is_contiguous():
            logits = logits.clone(memory_format=torch.contiguous_format)
        penalize(logits, [row for _, row in penalized], [seq.params for seq, _ in penalized],
                 [seq.prompt_token_set for seq, _ in penalized],
                 [seq.token_ids[seq.num_prompt_tokens:] for seq, _ in penalized])
        return logits

    def _token_logprobs(self, logits, samplers, chosen, failed) -> dict[Sequence, list]:
        items = [(seq, row + i, t) for seq, row in samplers
                 if seq.params.logprobs is not None and seq in chosen
                 for i, t in enumerate(chosen[seq])]
        return _per_sequence(items, failed, lambda batch: logprobs_of(
            logits[[r for _, r, _ in batch]], [t for _, _, t in batch],
            [seq.params.logprobs for seq, _, _ in batch]))

    def _finish_status(self, seq: Sequence, token: int, stopped_by_string: bool) -> SequenceStatus | None:
        p = seq.params
        if stopped_by_string or token in p.stop_token_ids or (
                not p.ignore_eos and token in self.eos_token_ids):
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _record_prompt_logprobs(self, logits: torch.Tensor, prompt_rows, failed) -> None:
        results = _per_sequence(prompt_rows, failed, lambda batch: logprobs_of(
            logits[[r for _, r, _ in batch]], [t for _, _, t in batch],
            [seq.params.prompt_logprobs for seq, _, _ in batch]))
        for seq, lps in results.items():
            seq.prompt_logprobs.extend(lps)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Offline batch generation (tests, benchmarks): output token ids per prompt."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                results[out.request_id].extend(out.new_token_ids)
        return [results[rid] for rid in ids]


def _per_sequence(items: list[tuple], failed: dict, compute) -> dict[Sequence, list]:
    """Run ``compute`` over ``items`` (tuples whose first element is a Sequence) as one
    batch and group its results by sequence. If the batch raises, run it again one
    sequence at a time, so only the sequences whose own items raise land in ``failed``."""
    if not items:
        return {}
    try:
        results = compute(items)
    except Exception:  # noqa: BLE001 - find the culprit below
        results = None
    out: dict[Sequence, list] = {}
    if results is not None:
        for item, result in zip(items, results):
            out.setdefault(item[0], []).append(result)
        return out
    per_seq: dict[Sequence, list[tuple]] = {}
    for item in items:
        per_seq.setdefault(item[0], []).append(item)
    for seq, own in per_seq.items():
        try:
            out[seq] = list(compute(own))
        except Exception as exc:  # noqa: BLE001 - this sequence's parameters
            failed[seq] = exc
    return out


def load_config(model_dir: Path) -> PretrainedConfig:
    """The checkpoint's ``config.json`` as a plain ``PretrainedConfig`` (every field as an
    attribute). Not ``AutoConfig``: that imports the architecture's config module, which
    pulls in ``torch.distributed.tensor`` — about 1.7 s of a worker's boot for nothing.
    Converted checkpoints (``sluice models``) write every field, so no class default is
    missed.

    Raises:
        OSError: the folder has no readable config.json.
    """
    return PretrainedConfig.from_json_file(str(Path(model_dir) / "config.json"))


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerFast:
    """The checkpoint's fast tokenizer (``tokenizer.json``, ``tokenizer_config.json``, chat
    template), loaded without ``AutoTokenizer``, which reads the model config through
    ``AutoConfig`` (see ``load_config``). Same ids, vocabulary, special tokens and chat
    template as ``AutoTokenizer`` on both catalogue models
    (tests/test_engine.py::test_the_engine_loads_the_tokenizer_autotokenizer_would).

    Raises:
        OSError: the folder has no tokenizer files.
    """
    return PreTrainedTokenizerFast.from_pretrained(model_dir)


def _eos_token_ids(model_dir: Path, tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if (model_dir / "generation_config.json").exists():
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def _draft_runner(config: EngineConfig, tokenizer, max_model_len: int) -> ModelRunner:
    """Load the speculative draft model; it must share the target's vocabulary."""
    draft_dir = Path(config.speculative_model)
    draft_config = load_config(draft_dir)
    if not set(getattr(draft_config, "architectures", None) or []) & set(SUPPORTED_ARCHITECTURES):
        raise ValueError(f"draft model {draft_dir}: architecture not supported by the native engine")
    if load_tokenizer(draft_dir).get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"draft model {draft_dir} does not share the target model's tokenizer")
    return ModelRunner(draft_config, draft_dir, max_model_len, config.block_size, config.dtype,
                       config.device, config.speculative_model_quantization)
