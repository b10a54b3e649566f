"""Run in a subprocess by test_tensor_parallel.py: XLA must see 8 CPU devices before JAX starts.

Prints one JSON line: for each model and parallel layout, the greedy token ids (or the error).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.tiny_models import make_tiny_checkpoint  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402

PROMPTS = [[5, 9, 77, 31], [100, 4, 8, 15, 16, 23, 42, 99, 7, 13, 200, 17], [33, 44]]
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_blocks=96)


def greedy(path: str, n: int, **parallel) -> list[list[int]] | str:
    try:
        llm = LLM(path, **ENGINE, **parallel)
    except ValueError as e:
        return f"ValueError: {e}"
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def main() -> None:
    import jax

    smollm2 = sys.argv[1] if len(sys.argv) > 1 else None
    root = tempfile.mkdtemp()
    out: dict = {"devices": jax.device_count()}
    # 4 KV heads so that TP=4 divides them
    make_tiny_checkpoint("LlamaForCausalLM", f"{root}/llama", num_key_value_heads=4)
    out["llama"] = {f"tp{tp}": greedy(f"{root}/llama", 24, tensor_parallel_size=tp) for tp in (1, 2, 4)}
    make_tiny_checkpoint("MixtralForCausalLM", f"{root}/mixtral")
    out["mixtral"] = {
        "tp1": greedy(f"{root}/mixtral", 24),
        "ep2": greedy(f"{root}/mixtral", 24, tensor_parallel_size=2, enable_expert_parallel=True),
        "tp2_without_ep": greedy(f"{root}/mixtral", 1, tensor_parallel_size=2),
    }
    if smollm2:  # 9 heads / 3 KV heads: TP=3 splits them, TP=2 cannot
        out["smollm2"] = {
            "tp1": greedy(smollm2, 16),
            "tp3": greedy(smollm2, 16, tensor_parallel_size=3),
            "tp2": greedy(smollm2, 1, tensor_parallel_size=2),
            "tp16": greedy(smollm2, 1, tensor_parallel_size=16),
        }
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
