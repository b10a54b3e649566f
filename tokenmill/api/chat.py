"""POST /v1/chat/completions: messages through the model's chat template, streamed or whole.

Streaming sends, per choice, a first chunk with `delta: {"role": "assistant", "content": ""}`, then
content deltas, the last one carrying `finish_reason`; `stream_options.include_usage` adds a final
chunk with empty `choices` and the usage. `logprobs: true` (+ `top_logprobs: k`) returns OpenAI's
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.api import streaming as s
from tokenmill.api.errors import from_value_error
from tokenmill.api.protocol import ChatCompletionRequest
from tokenmill.outputs import PositionLogprobs


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def format_logprobs(token_ids: list[int], positions: list[PositionLogprobs], num: int, tokenizer) -> dict:
    content = []
    for token, pos in zip(token_ids, positions):
        chosen = pos.get(token)
        text = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None \
            else tokenizer.decode([token])
        item = _entry(text, chosen.logprob if chosen is not None else float("-inf"))
        tops = sorted((lp for tid, lp in pos.items() if lp.rank is not None and lp.rank <= num),
                      key=lambda lp: lp.rank)
        item["top_logprobs"] = [_entry(lp.decoded_token or "", lp.logprob) for lp in tops[:num]]
        content.append(item)
    return {"content": content}


async def create_chat_completion(state, raw: Request, req: ChatCompletionRequest):
    model = state.check_model(req.model)
    engine = state.engine
    try:
        params = req.to_sampling_params()
    except ValueError as e:
        raise from_value_error(e) from None
    try:
        prompt = engine.process_chat(req.template_messages(), params, req.add_generation_prompt,
                                     req.chat_template)
    except ValueError as e:
        raise from_value_error(e, param="messages") from None
    except Exception as e:  # noqa: BLE001 - a template that fails on these messages (jinja errors)
        raise from_value_error(ValueError(f"the chat template failed on these messages: {e}"),
                               param="messages") from None
    request_id = s.random_id("chatcmpl")
    created = s.now_s()
    n = params.n
    top = req.top_logprobs or 0
    tokenizer = engine.tokenizer
    num_prompt_tokens = len(prompt.token_ids)

    def chunk(choices: list[dict]) -> dict:
        body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": choices}
        if req.include_usage:
            body["usage"] = None
        return body

    if req.stream:
        async def stream():
            generated = 0
            try:
                yield s.sse(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None} for i in range(n)]))
                async for _, out in s.merge_generations(engine, [prompt], request_id):
                    c = out.outputs[0]
                    generated += len(c.token_ids)
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    logprobs = format_logprobs(c.token_ids, c.logprobs or [], top, tokenizer) \
                        if req.logprobs else None
                    delta = {"content": c.text} if c.text or c.finish_reason is None else {}
                    yield s.sse(chunk([{"index": c.index, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": s.finish_reason(c.finish_reason),
                                        "stop_reason": c.stop_reason}]))
                if req.include_usage:
                    body = chunk([])
                    body["usage"] = s.usage(num_prompt_tokens, generated)
                    yield s.sse(body)
            except Exception as e:  # noqa: BLE001 - reported in-stream: the headers are sent
                yield s.sse_error(e)
            yield s.DONE

        return StreamingResponse(stream(), media_type="text/event-stream")

    choices = s.Choices(1, n)

    async def collect():
        async for _, out in s.merge_generations(engine, [prompt], request_id):
            choices.add(0, out)

    try:
        await s.until_disconnected(raw, collect())
    except Exception as e:  # noqa: BLE001
        raise s.engine_error(e) from None
    body_choices = []
    for k in range(n):
        logprobs = format_logprobs(choices.token_ids[k], choices.logprobs[k], top, tokenizer) \
            if req.logprobs else None
        body_choices.append({
            "index": k,
            "message": {"role": "assistant", "content": choices.text[k]},
            "logprobs": logprobs,
            "finish_reason": s.finish_reason(choices.finish_reason[k]),
            "stop_reason": choices.stop_reason[k],
        })
    return JSONResponse({
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "choices": body_choices,
        "usage": s.usage(num_prompt_tokens, choices.num_generated, choices.num_cached_tokens[0]),
    })
