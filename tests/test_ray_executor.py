"""The Ray executor on a real two-node Ray cluster on this machine (head + a node on 127.0.0.2, one
`tokenmill_device` each): placement, JAX across the two worker processes, greedy output equal to
the single-process engine's, a killed worker failing the engine fast, clear start-up errors."""

from __future__ import annotations

import gc
import os
import time

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from tests.tiny_models import make_tiny_checkpoint  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.executor.ray_cluster import rank_order, worker_env  # noqa: E402
from tokenmill.worker.worker import NodeInfo  # noqa: E402

PROMPTS = [[5, 9, 77, 31], [100, 4, 8, 15, 16, 23, 42, 99, 7, 13, 200, 17], [33, 44]]
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_blocks=96)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SECOND_NODE_IP = "127.0.0.2"


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # the head on the host's own address (one on 127.0.0.1 hangs the driver), the node on another
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, resources={"tokenmill_device": 1}))
    try:
        cluster.add_node(num_cpus=1, resources={"tokenmill_device": 1}, node_ip_address=SECOND_NODE_IP)
        ray.init(address=cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ray") / "llama")
    make_tiny_checkpoint("LlamaForCausalLM", path)
    return path


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def greedy_sync_steps(engine) -> list[list[int]]:
    """The same requests through EngineCore.step (no async scheduling)."""
    tokens = {f"sync{i}": [] for i in range(len(PROMPTS))}
    for req_id, prompt in zip(tokens, PROMPTS):
        engine.add_request(req_id, prompt, GREEDY)
    while engine.has_unfinished_requests():
        for update in engine.step():
            tokens[update.req_id] += update.new_token_ids
    return list(tokens.values())


@pytest.mark.slow
def test_two_hosts_one_jax_job_greedy_equals_single_process(cluster, llama):
    expected = greedy(LLM(llama, **ENGINE))
    assert all(len(ids) == GREEDY.max_tokens for ids in expected)
    llm = LLM(llama, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    executor = llm.engine.runner
    try:
        # one worker per node, the driver's node first
        head_ip = ray.util.get_node_ip_address()
        assert [info.ip for info in executor.placement] == [head_ip, SECOND_NODE_IP]
        assert len({info.node_id for info in executor.placement}) == 2
        # one JAX job over both worker processes, one device each
        described = executor.collective_rpc("describe")
        assert [(d["rank"], d["ip"]) for d in described] == [(0, head_ip), (1, SECOND_NODE_IP)]
        assert described[0]["pid"] != described[1]["pid"]
        for rank, d in enumerate(described):
            assert (d["process_index"], d["process_count"]) == (rank, 2)
            assert (d["device_count"], d["local_device_count"]) == (2, 1)
        assert greedy(llm) == expected  # async scheduling: launch / finish on the workers
        assert greedy_sync_steps(llm.engine) == expected  # execute_model
        # an LLM dropped without shutdown() frees its workers when it is collected
        workers = list(executor.workers)
        del llm, executor
        gc.collect()
        for worker in workers:
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(worker.describe.remote(), timeout=30)
    finally:
        if "executor" in locals():
            executor.shutdown()


@pytest.mark.slow
def test_killed_worker_fails_the_engine_within_seconds(cluster, llama, monkeypatch):
    monkeypatch.setenv("TOKENMILL_MULTIHOST_BACKEND", "ray")  # the environment's way of choosing Ray
    engine = LLM(llama, tensor_parallel_size=2, **ENGINE).engine
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
        for _ in range(3):
            engine.step_with_batch_queue()
        assert engine.has_unfinished_requests()
        ray.kill(engine.runner.workers[1])
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"worker rank 1 on {SECOND_NODE_IP} died during"):
            while engine.has_unfinished_requests():
                engine.step_with_batch_queue()
        assert time.monotonic() - start < 10
        # the executor is down: the next step fails at once, and rank 0 was stopped too
        with pytest.raises(RuntimeError, match="worker rank 1"):
            engine.step()
        assert engine.runner.workers == []
    finally:
        engine.runner.shutdown()


@pytest.mark.slow
def test_data_parallel_engine_cores_as_ray_actors(cluster, llama):
    """data_parallel_backend="ray": one engine-core actor per rank, one rank per node (one device
    each), ZMQ over TCP; greedy output equal to one engine's; shutdown frees the actors and their
    placement group; a killed rank fails what is in flight."""
    import asyncio

    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.engine.client import EngineDeadError

    expected = greedy(LLM(llama, **ENGINE))
    loop = asyncio.new_event_loop()
    engine = AsyncLLM.from_engine_args(llama, data_parallel_size=2, data_parallel_backend="ray", **ENGINE)
    client = engine.client
    try:
        assert sorted(core.node_ip for core in client.procs) == sorted([ray.util.get_node_ip_address(), SECOND_NODE_IP])
        assert client.input_address.startswith("tcp://")

        async def tokens(prompt, request_id, max_tokens=GREEDY.max_tokens):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            return [t async for out in engine.generate(prompt, params, request_id) for t in out.outputs[0].token_ids]

        async def both_ranks():
            outs = await asyncio.gather(*(tokens(p, f"r{i}") for i, p in enumerate(PROMPTS)))
            stats = await engine.call_utility_all("get_stats")
            return outs, [s["num_requests_received"] for s in stats]

        outs, per_rank = loop.run_until_complete(both_ranks())
        assert outs == expected
        assert all(n >= 1 for n in per_rank), per_rank  # both actors served

        async def kill_rank_1():
            long = [asyncio.ensure_future(tokens(p, f"long{i}", max_tokens=100)) for i, p in enumerate(PROMPTS * 2)]
            await asyncio.sleep(0)  # each coroutine sends its request, then waits for output
            assert 1 in {client.rank_of(f"long{i}") for i in range(len(long))}
            # killed at once: a fast machine finished all 100 tokens within the second this test used to wait
            ray.kill(client.procs[1].actor)
            return await asyncio.gather(*long, return_exceptions=True)

        start = time.monotonic()
        results = loop.run_until_complete(kill_rank_1())
        assert any(isinstance(r, EngineDeadError) for r in results), results
        assert time.monotonic() - start < 30
    finally:
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
    for core in client.procs:  # every actor is gone, the killed one and the one stopped
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(core.actor.pid.remote(), timeout=30)
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


@pytest.mark.slow
def test_placement_timeout_says_what_is_missing(cluster, tmp_path, monkeypatch):
    path = str(tmp_path / "llama4kv")
    make_tiny_checkpoint("LlamaForCausalLM", path, num_key_value_heads=4)  # so that TP=4 splits it
    monkeypatch.setenv("TOKENMILL_RAY_PLACEMENT_TIMEOUT_S", "2")
    with pytest.raises(RuntimeError) as e:
        LLM(path, tensor_parallel_size=4, distributed_executor_backend="ray", **ENGINE)
    message = str(e.value)
    assert "could not reserve 4 host(s) x 1 'tokenmill_device'" in message
    assert "within 2 s" in message and "2 alive node(s)" in message and f"{SECOND_NODE_IP}: 1" in message
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


@pytest.mark.slow
def test_driver_node_without_the_device_resource(cluster, llama, monkeypatch):
    monkeypatch.setenv("TOKENMILL_RAY_DEVICE_RESOURCE", "tpu_chip")
    with pytest.raises(RuntimeError, match=r"driver's Ray node .* has no 'tpu_chip' resource"):
        LLM(llama, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)


def test_invalid_backend_names_the_variable_and_choices(llama, monkeypatch):
    monkeypatch.setenv("TOKENMILL_MULTIHOST_BACKEND", "mpi")
    with pytest.raises(ValueError, match=r"invalid value 'mpi' for TOKENMILL_MULTIHOST_BACKEND; choices: '', ray"):
        LLM(llama, **ENGINE)
    monkeypatch.delenv("TOKENMILL_MULTIHOST_BACKEND")
    with pytest.raises(ValueError, match=r"distributed_executor_backend must be None \(in-process\) or 'ray'"):
        LLM(llama, distributed_executor_backend="mpi", **ENGINE)


def test_rank_order_driver_node_first_then_fewer_workers_then_ip():
    infos = [NodeInfo("10.0.0.10", "b", ()), NodeInfo("10.0.0.9", "c", ()), NodeInfo("10.0.0.2", "b", ()),
             NodeInfo("10.0.0.5", "driver", ()), NodeInfo("10.0.0.3", "d", ())]
    # the driver's node; then c and d (one worker each) by IP, 10.0.0.9 after 10.0.0.3; then b's two
    assert rank_order(infos, "driver") == [3, 4, 1, 2, 0]


def test_worker_env_copies_the_drivers_settings_but_not_its_place():
    env = {"TOKENMILL_SKIP_PRECOMPILE": "1", "XLA_FLAGS": "--xla_foo", "JAX_PLATFORMS": "cpu",
           "JAX_PROCESS_ID": "0", "JAX_COORDINATOR_ADDRESS": "a:1", "TOKENMILL_MULTIHOST_BACKEND": "ray",
           "CUDA_VISIBLE_DEVICES": "0,1", "HOME": "/root"}
    assert worker_env(env) == {"TOKENMILL_SKIP_PRECOMPILE": "1", "XLA_FLAGS": "--xla_foo", "JAX_PLATFORMS": "cpu"}
