"""Front-end input processing: prompts → token ids, chat templates, validation against the model."""

from __future__ import annotations

from typing import Any, Union

from tokenmill.model.loader import LoadedModel
from tokenmill.sampling_params import SamplingParams

# A prompt: text, token ids, or a dict with "prompt" or "prompt_token_ids" (vLLM's forms).
PromptType = Union[str, list[int], dict[str, Any]]


class Processor:
    def __init__(self, model: LoadedModel, max_model_len: int):
        self.tokenizer = model.tokenizer
        self.chat_template = model.chat_template
        self.vocab_size = model.config.vocab_size
        self.max_model_len = max_model_len

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of vocabulary (size {self.vocab_size})")
        total = len(token_ids) + (params.max_tokens or 1)
        if len(token_ids) >= self.max_model_len or (params.max_tokens is not None and total > self.max_model_len):
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(token_ids)} tokens and max_tokens is {params.max_tokens}"
            )

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> str:
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this model has no chat template; pass chat_template= or use generate()")
        return self.tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def tokenize_chat(self, text: str) -> list[int]:
        # The template already wrote any BOS, so the tokenizer must not add special tokens again.
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)
