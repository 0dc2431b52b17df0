"""Offline generation, colocated, shaped like vLLM's `LLM` so users feel at home.

    from pdserve import LLM, SamplingParams
    llm = LLM("path/to/hf-model", dtype="float32")
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

import torch
from tqdm import tqdm

from pdserve.engine import prompt_logprobs
from pdserve.engine.chat import Conversation, is_conversation, render_chat
from pdserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig, check_device
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.generation_defaults import load_generation_defaults
from pdserve.engine.loader import resolve_model_dir
from pdserve.engine.request import InvalidRequestError, RequestStatus, SamplingParams
from pdserve.engine.tokenizer import load_tokenizer

PromptInput = str | dict


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    # with SamplingParams(prompt_logprobs=k): [None, {prompt token and top-k id: logprob}, ...], one per
    # prompt token (the first has none), as vLLM's
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class _Tracker:
    """Per-request state the offline API keeps beside the engine: text and the final result."""

    prompt_index: int
    prompt: str | None
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    counted: bool = False  # in the progress bar of finished sequences
    prompt_logprobs: list[dict[int, float] | None] | None = None


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str | torch.dtype = "auto",
        device: str = "cpu",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        long_prefill_token_threshold: int = 0,
        max_model_len: int | None = None,
        seed: int = 0,
        model_impl: str = "auto",
        enforce_eager: bool = False,
    ) -> None:
        check_device(device)  # before building or fetching a model it could not run
        if model is None:
            from pdserve.demo_model import default_demo_model

            model = str(default_demo_model())
        model_dir = resolve_model_dir(model)
        self.generation_defaults = load_generation_defaults(model_dir)
        torch.manual_seed(seed)
        self.model_config = ModelConfig.from_hf(
            model_dir, dtype=dtype, device=device, max_model_len=max_model_len, model_impl=model_impl,
            enforce_eager=enforce_eager,
        )
        self.tokenizer = load_tokenizer(model_dir)
        self.engine = EngineCore(
            self.model_config,
            CacheConfig(block_size, num_kv_blocks, kv_cache_memory_bytes, enable_prefix_caching=enable_prefix_caching),
            SchedulerConfig(max_num_seqs, max_num_batched_tokens, long_prefill_token_threshold),
            device,
        )
        self._ids = itertools.count()

    def _prompt_ids(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise InvalidRequestError("each prompt must be a string or a dict with 'prompt_token_ids' (or 'prompt')")

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt in one continuous batch; outputs come back in prompt order. use_tqdm: a
        progress bar of finished sequences (n per prompt) on stderr (vLLM shows one by default)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = self._params_for(len(prompts), sampling_params)
        trackers: dict[str, _Tracker] = {}
        groups: list[list[str]] = []  # per prompt, the request ids of its n samples
        try:
            for index, (prompt, params) in enumerate(zip(prompts, params_list)):
                groups.append(self._add(index, prompt, params, trackers))
            with tqdm(total=len(trackers), desc="sequences", unit="seq", disable=not use_tqdm) as progress:
                self._run(trackers, progress)
        except BaseException:
            for request_id in trackers:
                self.engine.abort(request_id)
            raise
        return [self._result(group, trackers) for group in groups]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """generate() for one conversation or a list of them (OpenAI's message format), rendered by the model's
        chat template (or `chat_template`), as vLLM's LLM.chat; one output per conversation."""
        conversations = [messages] if is_conversation(messages) else list(messages)
        prompts = []
        for conversation in conversations:
            template = {} if chat_template is None else {"chat_template": chat_template}
            text = render_chat(self.tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, **(chat_template_kwargs or {}),
                               **template)
            # the template wrote the special tokens already
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (what generate() uses without any)."""
        return SamplingParams(**self.generation_defaults.as_kwargs())

    def _params_for(self, count: int, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise InvalidRequestError(f"got {len(sampling_params)} sampling params for {count} prompts")
        return list(sampling_params)

    def _add(self, index: int, prompt: PromptInput, params: SamplingParams, trackers: dict[str, _Tracker]) -> list[str]:
        """The prompt's n samples as n engine requests (sample i seeded seed + i, as the router does); their ids."""
        text, token_ids = self._prompt_ids(prompt)
        request_ids = []
        for sample in range(params.n):
            seed = None if params.seed is None else (params.seed + sample) % (1 << 63)
            # the prompt's logprobs are the same for every sample: the first computes them
            one = params
            if params.n > 1:
                one = params.replace(n=1, seed=seed, prompt_logprobs=None if sample else params.prompt_logprobs)
            request_id = str(next(self._ids))
            request = self.engine.make_request(request_id, token_ids, one)
            tracker = _Tracker(index, text, token_ids, IncrementalDetokenizer.for_params(self.tokenizer, token_ids, one))
            if one.prompt_logprobs is not None and len(token_ids) == 1:  # no position has a logprob
                tracker.prompt_logprobs = [None]
            trackers[request_id] = tracker
            self.engine.add_request(request)
            request_ids.append(request_id)
        return request_ids

    def _run(self, trackers: dict[str, _Tracker], progress: tqdm) -> None:
        while self.engine.has_work():
            deltas = self.engine.step()
            for request_id, tables in self.engine.take_prompt_logprobs():
                trackers[request_id].prompt_logprobs = prompt_logprobs.as_dicts(tables)
            for delta in deltas:
                if delta.finish_reason == "error":  # offline, the caller hears of it as an exception
                    failure = InvalidRequestError if delta.error_code == "invalid_request" else RuntimeError
                    raise failure(f"prompt {trackers[delta.request_id].prompt_index} failed: {delta.error}")
                tracker = trackers[delta.request_id]
                tracker.token_ids.extend(delta.token_ids)
                tracker.logprobs.extend(delta.logprobs)
                # a "stop" finish ends with the engine's stop token, whose text is left out (as the router does)
                tracker.detokenizer.add_tokens(delta.token_ids, ends_with_stop_token=delta.ends_with_stop_token)
                if tracker.detokenizer.stopped_by is not None:  # a stop string outranks the engine's reason
                    tracker.finish_reason, tracker.stop_reason = "stop", tracker.detokenizer.stopped_by
                    if delta.finish_reason is None:
                        self.engine.finish_request(delta.request_id, RequestStatus.FINISHED_STOPPED)
                elif delta.finish_reason is not None:
                    tracker.finish_reason, tracker.stop_reason = delta.finish_reason, delta.stop_reason
                if tracker.finish_reason is not None and not tracker.counted:
                    tracker.counted = True
                    progress.update()

    @staticmethod
    def _result(group: list[str], trackers: dict[str, _Tracker]) -> RequestOutput:
        samples = [trackers[request_id] for request_id in group]
        completions = [CompletionOutput(index, t.detokenizer.text, t.token_ids, t.finish_reason, t.stop_reason,
                                        t.logprobs or None) for index, t in enumerate(samples)]
        first = samples[0]
        return RequestOutput(group[0], first.prompt, first.prompt_token_ids, completions,
                             prompt_logprobs=first.prompt_logprobs)

    @property
    def kv_cache_manager(self):
        return self.engine.kv_cache_manager
