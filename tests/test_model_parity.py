"""Greedy parity with HF transformers on tiny random checkpoints of every supported family."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import CONFIGS, make_tiny_checkpoint
from tokenmill import LLM, SamplingParams

PROMPTS = [
    [5, 9, 77, 31],
    [100, 4, 8, 15, 16, 23, 42, 99, 7, 13, 200, 17, 19, 23, 250, 6, 4, 4, 9],
    [12] * 3 + list(range(40, 81)),  # crosses the sliding window of Mistral and Gemma 3
    [33, 44],
]
NEW_TOKENS = 32
TOP = 5


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the log-softmax at each step, by full forward passes (no cache, no EOS)."""
    ids = list(prompt)
    logprobs = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            logprobs.append(torch.log_softmax(logits, -1))
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], logprobs


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_greedy_parity(arch, tmp_path):
    model = make_tiny_checkpoint(arch, str(tmp_path / arch))
    llm = LLM(str(tmp_path / arch), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              block_size=4, num_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        expected, ref_logprobs = hf_greedy(model, prompt, NEW_TOKENS)
        completion = out.outputs[0]
        assert completion.token_ids == expected, f"{arch}: prompt of {len(prompt)} tokens diverged"
        for position, (ours, ref) in enumerate(zip(completion.logprobs, ref_logprobs)):
            assert len(ours) >= TOP
            for token, lp in ours.items():
                assert abs(lp.logprob - float(ref[token])) < 1e-3, (arch, position, token)
