"""What completions and chat share: running several generations at once, SSE framing, disconnects."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import AsyncIterator

from fastapi import Request

from tokenmill.api.errors import APIError
from tokenmill.engine.async_llm import AsyncLLM, EngineDeadError, ProcessedPrompt
from tokenmill.outputs import RequestOutput

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def engine_error(e: BaseException) -> APIError:
    """An error met while generating (after validation) as the API error to report."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        return APIError(500, f"the engine failed: {e}", code="engine_dead")
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    logger.error("generation failed: %s: %s", type(e).__name__, e)
    return APIError(500, f"internal server error: {type(e).__name__}: {e}")


def sse_error(e: BaseException) -> str:
    return sse(engine_error(e).body())


async def merge_generations(engine: AsyncLLM, prompts: list[ProcessedPrompt], request_id: str
                            ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run one generation per prompt concurrently; yield (prompt index, delta) as they come.

    Closing or cancelling this iterator cancels every generation (each aborts in the core)."""
    if len(prompts) == 1:
        async for out in engine.generate(prompts[0], prompts[0].params, request_id):
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    _END = object()

    async def run(i: int, p: ProcessedPrompt) -> None:
        try:
            async for out in engine.generate(p, p.params, f"{request_id}-p{i}"):
                queue.put_nowait((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            queue.put_nowait((i, _END))

    tasks = [asyncio.create_task(run(i, p)) for i, p in enumerate(prompts)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnected(request: Request, coro):
    """Await `coro`, but cancel it (aborting its generations) if the client goes away first."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise APIError(499, "client disconnected", code="client_disconnected")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


class Choices:
    """Accumulates the deltas of every (prompt, sample) into whole choices (non-streaming responses)."""

    def __init__(self, num_prompts: int, n: int):
        self.n = n
        size = num_prompts * n
        self.text = [""] * size
        self.token_ids: list[list[int]] = [[] for _ in range(size)]
        self.logprobs: list[list] = [[] for _ in range(size)]
        self.finish_reason: list[str | None] = [None] * size
        self.stop_reason: list = [None] * size
        self.prompt_logprobs: list = [None] * num_prompts
        self.num_cached_tokens = [0] * num_prompts

    def add(self, prompt_index: int, out: RequestOutput) -> int:
        c = out.outputs[0]
        k = prompt_index * self.n + c.index
        self.text[k] += c.text
        self.token_ids[k].extend(c.token_ids)
        if c.logprobs:
            self.logprobs[k].extend(c.logprobs)
        if c.finish_reason is not None:
            self.finish_reason[k], self.stop_reason[k] = c.finish_reason, c.stop_reason
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = out.prompt_logprobs
        self.num_cached_tokens[prompt_index] = out.num_cached_tokens
        return k

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.token_ids)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish reasons: "stop" | "length" (an aborted sample reports "stop")."""
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"
