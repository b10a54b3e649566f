"""Per-step cost of the Ray executor against in-process workers: ms per engine step while a fixed
batch decodes, through EngineCore.step (sync) and step_with_batch_queue (async scheduling).

    flock /tmp/bench.lock .venv/bin/python benchmarks/ray_step_overhead.py MODE TP MODEL_DIR

MODE: inproc (TP > 1: TP forced CPU devices in this process), ray1 (a local Ray cluster started by
the engine: one worker), ray2 (a two-node Ray cluster on this machine, head plus a node on
127.0.0.2, one device each: two workers, one JAX job). MODEL_DIR: an HF checkpoint, e.g. the tiny
Llama of tests/tiny_models.py with vocab_size=49152. Prints one line: RESULT {json}.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

BATCH, PROMPT_LEN, STEPS, REPS = 16, 32, 100, 3


def main() -> None:
    mode, tp, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if mode == "inproc" and tp > 1:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={tp}"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from tokenmill import LLM, SamplingParams

    cluster = None
    if mode == "ray2":
        import ray
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, resources={"tokenmill_device": 1}))
        cluster.add_node(num_cpus=1, resources={"tokenmill_device": 1}, node_ip_address="127.0.0.2")
        ray.init(address=cluster.address)
    engine_args = dict(max_model_len=256, max_num_batched_tokens=256, max_num_seqs=BATCH, num_blocks=512,
                       tensor_parallel_size=tp)
    if mode != "inproc":
        engine_args["distributed_executor_backend"] = "ray"
    engine = LLM(model, **engine_args).engine
    params = SamplingParams(temperature=0.0, max_tokens=220, ignore_eos=True)
    result = {"mode": mode, "tp": tp, "batch": BATCH}
    for name, step in (("sync", engine.step), ("async", engine.step_with_batch_queue)):
        samples = []
        for rep in range(REPS):
            ids = [f"{name}{rep}-{i}" for i in range(BATCH)]
            for i, req_id in enumerate(ids):
                engine.add_request(req_id, [1000 + 37 * i + j for j in range(PROMPT_LEN)], params)
            for _ in range(6):  # every prompt prefilled (256-token budget): steady decode from here
                step()
            start = time.perf_counter()
            for _ in range(STEPS):
                step()
            samples.append(1e3 * (time.perf_counter() - start) / STEPS)
            engine.abort_requests(ids)
            while engine.has_unfinished_requests():
                step()
        result[f"{name}_ms_per_step"] = statistics.median(samples)
        result[f"{name}_samples"] = [round(s, 2) for s in samples]
    print("RESULT " + json.dumps(result), flush=True)
    if mode != "inproc":
        engine.runner.shutdown()
    if cluster is not None:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
