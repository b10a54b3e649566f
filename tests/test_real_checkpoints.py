"""Real checkpoints from their GGUF files against transformers loading the same GGUF: greedy parity."""

from __future__ import annotations

import os

import jax
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.ops.cpu import linear as cpu_linear

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "The three primary colours are",
    "Water boils at a temperature of",
    "In 1969, the first humans to walk on the Moon were Neil Armstrong and",
    "Translate to French: good morning ->",
]
NEW_TOKENS = 32


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy continuation with the KV cache, EOS not special (tokenmill runs with ignore_eos)."""
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(n - 1):
            out = model(torch.tensor([[tokens[-1]]]), cache=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def hf_from_gguf(path: str):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("checkpoint", ["smollm2_path", "gemma3_path"])
def test_greedy_parity_with_transformers_on_gguf(checkpoint, request):
    path = request.getfixturevalue(checkpoint)
    llm = LLM(path, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    if checkpoint == "smollm2_path" and jax.default_backend() == "cpu" and cpu_linear.available():
        # gate and up side by side, in the kernel's strips: both covered here
        assert llm.engine.runner.params["layers"]["w_gate_up"].ndim == 4
    reference = hf_from_gguf(path)
    for prompt, out in zip(PROMPTS, outputs):
        expected = hf_greedy(reference, out.prompt_token_ids, NEW_TOKENS)
        assert out.outputs[0].token_ids == expected, f"{checkpoint}: {prompt!r} diverged"
