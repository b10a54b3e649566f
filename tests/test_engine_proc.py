"""The engine core in its own process (core_proc.py) behind AsyncLLM (client.py, async_llm.py): handshake,
streaming deltas, aborts, stop strings, utility calls, start-up failures, a dying core, a dying parent.

The AsyncLLM tests use a tiny random Llama (fast to load and compile); the server-level kill -9 test
runs `tokenmill serve` on the embedded SmolLM2.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from serving import SMALL_ENGINE_ARGS, ServerProcess, drain_until_dead, metrics, wait_for
from tokenmill.sampling_params import SamplingParams

TINY_ARGS = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_blocks=64)
PROMPT = [5, 17, 42, 99, 7, 3]


def write_tiny_llama(path, vocab: int = 256, hidden: int = 64, layers: int = 2, seed: int = 0) -> str:
    """A random 2-layer Llama with a word-level tokenizer, written with numpy (no torch import: fast)."""
    import numpy as np
    import transformers
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(path, exist_ok=True)
    heads, kv_heads, inter = 4, 2, 128
    head_dim = hidden // heads
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2,
              "tie_word_embeddings": False, "torch_dtype": "float32"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(vocab, hidden), "lm_head.weight": w(vocab, hidden),
               "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        pre = f"model.layers.{i}."
        tensors.update({
            pre + "input_layernorm.weight": np.ones(hidden, np.float32),
            pre + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
            pre + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            pre + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            pre + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            pre + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            pre + "mlp.gate_proj.weight": w(inter, hidden),
            pre + "mlp.up_proj.weight": w(inter, hidden),
            pre + "mlp.down_proj.weight": w(hidden, inter),
        })
    save_file(tensors, os.path.join(path, "model.safetensors"))
    words = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>", pad_token="<pad>").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def skip_precompile():
    old = os.environ.get("TOKENMILL_SKIP_PRECOMPILE")
    os.environ["TOKENMILL_SKIP_PRECOMPILE"] = "1"
    yield
    if old is None:
        os.environ.pop("TOKENMILL_SKIP_PRECOMPILE", None)
    else:
        os.environ["TOKENMILL_SKIP_PRECOMPILE"] = old


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(tiny_dir, skip_precompile, loop):
    from tokenmill.engine.async_llm import AsyncLLM

    eng = AsyncLLM.from_engine_args(tiny_dir, **TINY_ARGS)
    yield eng
    eng.shutdown()


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


async def _collect(engine, prompt, params, request_id):
    outs = []
    async for out in engine.generate(prompt, params, request_id):
        outs.append(out)
    return outs


def test_generate_streams_deltas_equal_to_offline_llm(engine, loop, tiny_dir):
    outs = loop.run_until_complete(_collect(engine, PROMPT, _greedy(12, logprobs=2), "greedy"))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    text = "".join(o.outputs[0].text for o in outs)
    logprobs = [lp for o in outs for lp in o.outputs[0].logprobs]
    assert len(tokens) == len(logprobs) == 12 and outs[-1].outputs[0].finish_reason == "length"

    from tokenmill import LLM

    ref = LLM(tiny_dir, **TINY_ARGS).generate([PROMPT], _greedy(12), use_tqdm=False)[0].outputs[0]
    assert tokens == ref.token_ids and text == ref.text


def test_speculative_decoding_streams_what_the_offline_llm_gives(tiny_dir, skip_precompile, loop):
    """The engine core process verifies n-gram proposals (several tokens a step, streamed as one
    delta); the stream equals plain offline decoding."""
    from tokenmill import LLM
    from tokenmill.engine.async_llm import AsyncLLM

    prompt = [9] * 8  # the tiny model's output repeats a token at first
    ref = LLM(tiny_dir, **TINY_ARGS).generate([prompt], _greedy(40), use_tqdm=False)[0].outputs[0]
    spec = AsyncLLM.from_engine_args(tiny_dir, **TINY_ARGS, speculative_config={"prompt_lookup_min": 1})
    try:
        outs = loop.run_until_complete(_collect(spec, prompt, _greedy(40, logprobs=1), "spec"))
        stats = loop.run_until_complete(spec.get_stats())
    finally:
        spec.shutdown()
    assert [t for o in outs for t in o.outputs[0].token_ids] == ref.token_ids
    assert "".join(o.outputs[0].text for o in outs) == ref.text
    assert 0 < stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert len(outs) < 40  # some steps delivered several tokens
    assert len([lp for o in outs for lp in o.outputs[0].logprobs]) == 40  # one per token


def test_cancelled_generation_is_aborted_in_the_core(engine, loop):
    async def scenario():
        before = (await engine.get_stats())["num_aborted_requests"]
        gen = engine.generate(PROMPT, _greedy(100), "to-cancel")
        await gen.__anext__()
        await gen.__anext__()
        await gen.aclose()  # as when a client goes away

        async def settled():
            st = await engine.get_stats()
            return st if st["num_aborted_requests"] == before + 1 and st["num_running"] == 0 else None

        for _ in range(50):
            st = await settled()
            if st:
                return st
            await asyncio.sleep(0.1)
        raise AssertionError(await engine.get_stats())

    stats = loop.run_until_complete(scenario())
    assert stats["kv_cache_usage"] == 0.0 and engine.num_in_flight == 0


def test_stop_string_finishes_in_the_front_end_and_aborts_in_the_core(engine, loop):
    full = loop.run_until_complete(_collect(engine, PROMPT, _greedy(20), "full"))
    text = "".join(o.outputs[0].text for o in full)
    words = text.split()
    stop = words[3]
    expected = text[: text.index(stop)]

    async def scenario():
        before = (await engine.get_stats())["num_aborted_requests"]
        outs = await _collect(engine, PROMPT, _greedy(20, stop=[stop]), "stopped")
        await asyncio.sleep(0.3)
        return outs, (await engine.get_stats())["num_aborted_requests"] - before

    outs, aborted = loop.run_until_complete(scenario())
    assert "".join(o.outputs[0].text for o in outs) == expected
    assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].stop_reason == stop
    assert aborted == 1


def test_n_fans_out_into_seeded_samples(engine, loop):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)

    async def run():
        outs = await _collect(engine, PROMPT, params, "fan")
        per_index: dict[int, list[int]] = {}
        for o in outs:
            per_index.setdefault(o.outputs[0].index, []).extend(o.outputs[0].token_ids)
            assert o.request_id == "fan"
        return outs, per_index

    outs_a, a = loop.run_until_complete(run())
    _, b = loop.run_until_complete(run())
    assert sorted(a) == [0, 1, 2] and all(len(t) == 6 for t in a.values())
    assert a == b  # seed + index: reproducible
    assert len({tuple(t) for t in a.values()}) > 1
    assert outs_a[-1].finished and sum(o.finished for o in outs_a) == 1


def test_utility_calls_and_bad_requests(engine, loop):
    stats = loop.run_until_complete(engine.get_stats())
    assert {"num_running", "num_waiting", "kv_cache_usage", "prefix_cache_hit_rate", "num_preemptions",
            "num_aborted_requests"} <= set(stats)
    assert loop.run_until_complete(engine.reset_prefix_cache()) is True
    with pytest.raises(RuntimeError, match="unknown utility method 'no_such_method'"):
        loop.run_until_complete(engine.client.call_utility("no_such_method"))
    for prompt, params in (([], _greedy(4)), ([1] * 200, _greedy(4)), (PROMPT, _greedy(200)), ([10**6], _greedy(4))):
        with pytest.raises(ValueError):
            loop.run_until_complete(_collect(engine, prompt, params, "bad"))
    assert engine.num_in_flight == 0
    # none of them reached the core: it still answers, with nothing queued
    stats = loop.run_until_complete(engine.get_stats())
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_killed_core_fails_every_inflight_request_at_once(engine, loop):
    from tokenmill.engine.async_llm import EngineDeadError

    async def scenario():
        gens = [engine.generate(PROMPT, _greedy(120), f"doomed-{i}") for i in range(3)]
        for g in gens:
            await g.__anext__()
        os.kill(engine.client.pid, signal.SIGKILL)
        start = time.monotonic()

        errors = await asyncio.wait_for(asyncio.gather(*(drain_until_dead(g) for g in gens)), timeout=10)
        return errors, time.monotonic() - start

    errors, elapsed = loop.run_until_complete(scenario())
    assert all(isinstance(e, EngineDeadError) for e in errors) and elapsed < 5.0
    assert engine.errored and "died" in engine.dead_reason
    with pytest.raises(EngineDeadError):  # new requests fail at once
        loop.run_until_complete(_collect(engine, PROMPT, _greedy(2), "after"))


def test_fatal_error_in_the_core_sends_engine_core_dead_and_exits_1(tiny_dir, skip_precompile, loop):
    from serving import run_failing_engine_core
    from tokenmill.engine import messages as m
    from tokenmill.config import engine_config_from_kwargs
    from tokenmill.engine.client import EngineCoreClient

    config, _ = engine_config_from_kwargs(tiny_dir, **TINY_ARGS)
    client = EngineCoreClient(config, target=run_failing_engine_core)
    try:
        async def scenario():
            dead = asyncio.get_running_loop().create_future()
            client.start(asyncio.get_running_loop(), lambda outputs: None, dead.set_result)
            client.add_request(m.EngineCoreRequest("r", PROMPT, m.params_to_dict(_greedy(4))))
            return await asyncio.wait_for(dead, 30)

        reason = loop.run_until_complete(scenario())
        assert "reported a fatal error" in reason  # the sentinel, before the process is seen gone
        # the client's monitor thread reaps the process: wait for it rather than join here too
        assert wait_for(lambda: client.procs[0].exitcode is not None, 30), "the core did not exit"
        assert client.procs[0].exitcode == 1
    finally:
        client.shutdown()


def test_core_exits_when_its_parent_dies(tmp_path):
    """A front end that dies (kill -9) mid-handshake: its engine core notices and exits."""
    script = textwrap.dedent("""
        import multiprocessing, os, sys, time, zmq
        from tokenmill.engine.core_proc import run_engine_core
        if __name__ == "__main__":
            address = "ipc://" + sys.argv[1]
            router = zmq.Context().socket(zmq.ROUTER)
            router.bind(address)
            proc = multiprocessing.get_context("spawn").Process(target=run_engine_core, args=(address, os.getpid()))
            proc.start()
            router.recv_multipart()  # HELLO: the core is up and waiting for its init
            print(proc.pid, flush=True)
            time.sleep(600)
    """)
    path = tmp_path / "parent.py"
    path.write_text(script)
    parent = subprocess.Popen([sys.executable, str(path), str(tmp_path / "sock")], stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait(10)

        def gone():
            try:
                os.kill(core_pid, 0)
            except ProcessLookupError:
                return True
            with open(f"/proc/{core_pid}/stat") as f:  # a zombie of init counts as gone
                return f.read().split()[2] == "Z"

        assert wait_for(gone, 10), "the engine core outlived its parent"
    finally:
        parent.kill()


# ---- tokenmill serve: start-up failures and a dying engine ------------------------------------


def _serve(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    from serving import _tokenmill_cmd

    env = {**os.environ, "TOKENMILL_SKIP_PRECOMPILE": "1"}
    return subprocess.run(_tokenmill_cmd() + ["serve", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("tokenmill: error:")]


def test_serve_nonexistent_model_exits_with_one_clear_line():
    result = _serve(["/nonexistent", "--port", "0"], timeout=60)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    (line,) = _error_lines(result.stderr)
    assert "/nonexistent" in line and "does not exist" in line


def test_serve_bad_speculative_config_exits_with_one_clear_line():
    result = _serve(["--speculative-config", '{"method": "ngram", "prompt_lookup_min": 5}'], timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "speculative_config.prompt_lookup_min (5) exceeds prompt_lookup_max (4)" in result.stderr.splitlines()[-1]


def test_serve_engine_that_cannot_start_exits_with_one_clear_line(tiny_dir):
    result = _serve([tiny_dir, "--port", "0", "--max-model-len", "128", "--kv-cache-memory", "1000"], timeout=180)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    (line,) = _error_lines(result.stderr)
    assert "engine failed to start" in line and "KV cache budget" in line


@pytest.mark.slow
def test_serve_with_speculative_decoding(tmp_path, smollm2_path):
    """`tokenmill serve --speculative-config`: the same text as offline plain decoding, several tokens
    per streamed chunk, and the proposals counted in /metrics."""
    from tokenmill import LLM

    prompt = "List the days of the week: Monday, Tuesday,"
    expected = LLM(smollm2_path, max_model_len=512).generate([prompt], SamplingParams(temperature=0, max_tokens=40),
                                                             use_tqdm=False)[0].outputs[0].text
    srv = ServerProcess(["--host", "127.0.0.1", "--port", "0", *SMALL_ENGINE_ARGS, "--disable-access-log",
                         "--speculative-config", '{"num_speculative_tokens": 4}'], tmp_path / "server.log")
    try:
        srv.wait_ready()
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0}
        assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == expected
        chunks = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected
        assert len(chunks) < 40
        m = metrics(srv.url)
        assert 0 < m["tokenmill:spec_decode_num_accepted_tokens_total"] <= m["tokenmill:spec_decode_num_draft_tokens_total"]
    finally:
        srv.stop()


@pytest.mark.slow
def test_serve_kill_9_of_engine_core(tmp_path, smollm2_path):
    srv = ServerProcess(["--host", "127.0.0.1", "--port", "0", *SMALL_ENGINE_ARGS, "--disable-access-log"],
                        tmp_path / "server.log")
    try:
        srv.wait_ready()
        url = srv.url
        results: list[dict] = [{} for _ in range(3)]
        started = [threading.Event() for _ in range(3)]

        def stream(i: int) -> None:
            body = {"prompt": f"Tell me a story, number {i}.", "max_tokens": 300, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            data = json.loads(line[6:])
                            if "error" in data:
                                results[i].update(error=data["error"], at=time.monotonic())
                            started[i].set()
            except Exception as e:  # noqa: BLE001
                results[i].update(error=repr(e), at=time.monotonic())
            finally:
                started[i].set()

        def whole() -> None:
            try:
                r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 300,
                                                              "ignore_eos": True}, timeout=60)
                results[2].update(status=r.status_code, body=r.json(), at=time.monotonic())
            except Exception as e:  # noqa: BLE001
                results[2].update(error=repr(e), at=time.monotonic())

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)] + [threading.Thread(target=whole)]
        for t in threads:
            t.start()
        assert started[0].wait(120) and started[1].wait(120)
        time.sleep(0.5)
        os.kill(srv.core_pid(), signal.SIGKILL)
        killed_at = time.monotonic()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads), "a request hung after the engine died"
        for res in results[:2]:
            assert res["error"]["code"] == "engine_dead" and res["at"] - killed_at < 5.0, res
        assert results[2]["status"] == 500 and results[2]["body"]["error"]["code"] == "engine_dead"
        assert results[2]["at"] - killed_at < 5.0
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        assert srv.wait_exit(30) != 0
        assert any("engine core process died" in line for line in _error_lines(srv.log_path.read_text()))
    finally:
        srv.stop()
