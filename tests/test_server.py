"""The OpenAI-compatible server end to end: a real `tokenmill serve` (the embedded SmolLM2) on loopback in
a subprocess, a real engine-core process behind ZMQ, the official `openai` client.

One server for the module (its start-up and shape compiles dominate the time); the last test
SIGTERMs it. The heavy tests are marked slow.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest

from serving import SMALL_ENGINE_ARGS, ServerProcess, metrics, wait_for

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY_PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = ServerProcess(
        ["--host", "127.0.0.1", "--port", "0", *SMALL_ENGINE_ARGS, "--api-key", API_KEY, "--disable-access-log"],
        log, env={"TOKENMILL_SHUTDOWN_GRACE_S": "90"},
    )
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def llm(server):
    """The offline engine with the server's settings: the reference for greedy text."""
    old = os.environ.get("TOKENMILL_SKIP_PRECOMPILE")
    os.environ["TOKENMILL_SKIP_PRECOMPILE"] = "1"
    try:
        from tokenmill import LLM

        yield LLM(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256)
    finally:
        if old is None:
            os.environ.pop("TOKENMILL_SKIP_PRECOMPILE", None)
        else:
            os.environ["TOKENMILL_SKIP_PRECOMPILE"] = old


def _greedy(max_tokens: int, **kw):
    from tokenmill import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def _post(server, path: str, body, headers=AUTH) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, timeout=120,
                      headers={"content-type": "application/json", **(headers or {})})


# ---- light: routes, auth, bad input ------------------------------------------------------------


def test_models_health_version(server):
    r = httpx.get(f"{server.url}/v1/models", headers=AUTH)
    assert r.status_code == 200
    (model,) = r.json()["data"]
    assert model["id"] == server.model == "SmolLM2-135M-Instruct" and model["max_model_len"] == 512
    assert httpx.get(f"{server.url}/health").status_code == 200  # public: no key needed
    assert httpx.get(f"{server.url}/version").json()["version"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_api_key_required(server, headers):
    r = httpx.get(f"{server.url}/v1/models", headers=headers)
    assert r.status_code == 401
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"


def test_cors_preflight(server):
    r = httpx.options(f"{server.url}/v1/completions", headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "http://example.com")


CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
BAD_INPUTS = [
    # (path, body, status, param)
    (CMPL, b"{not json", 400, None),
    (CMPL, b"[1, 2]", 400, None),
    (CMPL, b"", 400, None),
    (CMPL, {"max_tokens": 4}, 400, "prompt"),
    (CMPL, {"prompt": ""}, 400, "prompt"),
    (CMPL, {"prompt": []}, 400, "prompt"),
    (CMPL, {"prompt": ["ok", ""]}, 400, "prompt"),
    (CMPL, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    (CMPL, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    (CMPL, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (CMPL, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    (CMPL, {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    (CMPL, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "n": 0}, 400, "n"),
    (CMPL, {"prompt": "hi", "n": 2, "temperature": 0}, 400, "n"),
    (CMPL, {"prompt": "hi", "presence_penalty": 5}, 400, "presence_penalty"),
    (CMPL, {"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    (CMPL, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (CMPL, {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    (CMPL, {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "stop_token_ids": [99999999]}, 400, "stop_token_ids"),
    (CMPL, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    (CMPL, {"prompt": "hi", "seed": "x"}, 400, "seed"),
    (CMPL, {"prompt": "hi", "stream": False, "stream_options": {"include_usage": True}}, 400, None),
    (CMPL, {"prompt": "hi", "max_tokens": 600}, 400, "prompt"),  # prompt + max_tokens > 512
    (CMPL, {"prompt": [1000] * 600}, 400, "prompt"),  # the prompt alone is over the context
    (CMPL, {"prompt": [10**9]}, 400, "prompt"),  # out of vocabulary
    (CMPL, {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"model": "x"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, None),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": USER, "max_tokens": 10_000}, 400, "messages"),
    (CHAT, {"messages": USER, "model": "no-such-model"}, 404, "model"),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
]


def test_bad_inputs_get_openai_errors_and_never_reach_the_core(server):
    before = metrics(server.url)["tokenmill:prefix_cache_queries_total"]
    failures = []
    for path, body, status, param in BAD_INPUTS:
        r = _post(server, path, body)
        try:
            err = r.json()["error"]
            ok = (r.status_code == status and set(err) == {"message", "type", "param", "code"}
                  and isinstance(err["message"], str) and err["message"]
                  and (param is None or err["param"] == param))
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            failures.append(f"{path} {body!r}: {r.status_code} {r.text[:300]}")
    assert not failures, "\n".join(failures)
    # none of them was queued in the engine core: it looked up no prompt tokens
    assert metrics(server.url)["tokenmill:prefix_cache_queries_total"] == before
    # and the server keeps serving
    r = _post(server, CMPL, {"prompt": GREEDY_PROMPT, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_tokenize_detokenize(server):
    r = _post(server, "/tokenize", {"prompt": GREEDY_PROMPT})
    assert r.status_code == 200
    tokens = r.json()["tokens"]
    assert r.json()["count"] == len(tokens) > 0
    assert _post(server, "/detokenize", {"tokens": tokens}).json()["prompt"] == GREEDY_PROMPT
    chat = _post(server, "/tokenize", {"messages": USER}).json()
    assert chat["count"] > len(tokens)  # the template adds the system prompt and role markers


# ---- heavy: generation through the openai client -----------------------------------------------


@pytest.mark.slow
def test_openai_completions_match_offline_llm(server, client, llm):
    ref = llm.generate([GREEDY_PROMPT], _greedy(8), use_tqdm=False)[0].outputs[0]
    out = client.completions.create(model=server.model, prompt=GREEDY_PROMPT, max_tokens=8, temperature=0)
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ("length" if len(ref.token_ids) == 8 else "stop")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, len(ref.token_ids))

    # streamed, with usage, and a token-id prompt: the same text
    ids = llm.get_tokenizer()(GREEDY_PROMPT).input_ids
    chunks = list(client.completions.create(model=server.model, prompt=ids, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)

    # logprobs, echo, stop
    out = client.completions.create(model=server.model, prompt=GREEDY_PROMPT, max_tokens=4, temperature=0,
                                    logprobs=2, echo=True)
    choice = out.choices[0]
    assert choice.text == GREEDY_PROMPT + llm.get_tokenizer().decode(ref.token_ids[:4])
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5 + 4
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    stop = ref.text.strip().split()[0][1:]
    aborted = metrics(server.url)["tokenmill:num_aborted_requests_total"]
    out = client.completions.create(model=server.model, prompt=GREEDY_PROMPT, max_tokens=8, temperature=0,
                                    stop=[stop])
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == ref.text[: ref.text.index(stop)]
    # the stop string was found in the front end, which aborted the request in the core
    assert metrics(server.url)["tokenmill:num_aborted_requests_total"] == aborted + 1


@pytest.mark.slow
def test_openai_chat_match_offline_llm(server, client, llm):
    messages = [{"role": "user", "content": "Name three colours."}]
    ref = llm.chat(messages, _greedy(10), use_tqdm=False)[0].outputs[0]
    out = client.chat.completions.create(model=server.model, messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.completion_tokens == len(ref.token_ids)

    stream = client.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=10,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            logprobs=True, top_logprobs=2)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    content_lps = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(content_lps) == len(ref.token_ids)
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content_lps)
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)

    # n=2 sampled with a seed: two choices, reproducible
    kw = dict(model=server.model, messages=messages, max_tokens=4, temperature=1.0, n=2, seed=1234)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert 2 <= a.usage.completion_tokens <= 8


@pytest.mark.slow
def test_concurrent_streams_each_get_their_own_text(server, llm):
    prompts = [f"Question {i}: what comes after the number {i * 7}? Answer:" for i in range(64)]
    refs = [o.outputs[0].text for o in llm.generate(prompts, _greedy(8), use_tqdm=False)]
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=240)

    async def one(prompt: str) -> tuple[str, str]:
        stream = await aclient.completions.create(model=server.model, prompt=prompt, max_tokens=8,
                                                  temperature=0, stream=True)
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def run_all():
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    results = asyncio.run(run_all())
    assert [r[0] for r in results] == refs
    assert all(r[1] in ("stop", "length") for r in results)
    assert httpx.get(f"{server.url}/health").status_code == 200
    m = wait_for(lambda: (lambda m: m if m["tokenmill:num_requests_running"] == 0 else None)(metrics(server.url)), 10)
    assert m["tokenmill:kv_cache_usage_perc"] == 0.0


@pytest.mark.slow
def test_client_disconnect_aborts_in_core_and_frees_blocks(server):
    before = metrics(server.url)
    body = {"prompt": "Write a long story about a dragon.", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}{CMPL}", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks += 1
                if chunks == 3:
                    break  # leaving the block closes the connection mid-stream

    def settled():
        m = metrics(server.url)
        aborted = m["tokenmill:num_aborted_requests_total"] > before["tokenmill:num_aborted_requests_total"]
        return m if aborted and m["tokenmill:num_requests_running"] == 0 else None

    m = wait_for(settled, 15)
    assert m, f"request not aborted in the core: {metrics(server.url)}"
    assert m["tokenmill:kv_cache_usage_perc"] == 0.0
    assert m["tokenmill:request_success_total:abort"] > before["tokenmill:request_success_total:abort"]
    assert m["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"] < 400


@pytest.mark.slow
def test_bench_serve_against_the_server(server, tmp_path):
    from serving import _tokenmill_cmd

    out = tmp_path / "bench.json"
    cmd = _tokenmill_cmd() + ["bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "6",
                              "--input-len", "16", "--output-len", "4", "--max-concurrency", "3",
                              "--request-rate", "20", "--output-json", str(out), "--no-progress"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["successful_requests"] == 6 and summary["failed_requests"] == 0
    assert summary["total_output_tokens"] == 24 and summary["output_tok_s"] > 0
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < summary[f"median_{name}_ms"] <= summary[f"p99_{name}_ms"]
    sent = [r["sent_s"] for r in summary["requests"]]
    assert len(sent) == 6 and sent == sorted(sent) and sent[-1] > 0  # a Poisson process: spread in time
    assert all(0 < r["ttft_s"] <= r["e2el_s"] for r in summary["requests"])
    # the benchmark waited for the shape buckets to compile (none left compiling afterwards)
    assert metrics(server.url)["tokenmill:num_ranks_precompiling"] == 0
    assert out.with_suffix(".png").stat().st_size > 1000  # the latency PNG (matplotlib is a test extra)


# ---- last: SIGTERM drains the module's server ----------------------------------------------------


@pytest.mark.slow
def test_sigterm_lets_inflight_requests_finish_then_exits_0(server):
    # long enough to outlast the checks below: 12 tokens once finished (and the server exited) before
    # the health check, on a machine that decodes them in ~0.4 s
    max_tokens = 64
    results: list[dict] = [{} for _ in range(3)]
    started = [threading.Event() for _ in range(3)]

    def run(i: int) -> None:
        body = {"prompt": f"Story number {i}:", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", f"{server.url}{CMPL}", json=body, headers=AUTH, timeout=180) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        results[i]["error"] = data["error"]
                    elif data["choices"]:
                        started[i].set()
                        results[i]["reason"] = data["choices"][0]["finish_reason"] or results[i].get("reason")
                    else:
                        results[i]["usage"] = data["usage"]
        except Exception as e:  # noqa: BLE001
            results[i]["error"] = repr(e)
        finally:
            started[i].set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in started)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    r = _post(server, CMPL, {"prompt": "late", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    assert httpx.get(f"{server.url}/health").status_code == 503
    for t in threads:
        t.join(120)
    assert all("error" not in res for res in results), results
    assert all(res["reason"] == "length" and res["usage"]["completion_tokens"] == max_tokens for res in results)
    assert server.wait_exit(60) == 0
