"""POST /v1/completions: text (or token-id) prompts, streamed as SSE or answered whole.

`prompt` may be a string, a list of strings, a list of token ids or a list of lists of ids (as
OpenAI's API). Choice `index` is prompt_index * n + sample_index. `logprobs: k` returns OpenAI's
legacy shape (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`); with `echo` the prompt's
text (and, with logprobs, its logprobs) comes first.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.api import streaming as s
from tokenmill.api.errors import from_value_error
from tokenmill.api.protocol import CompletionRequest
from tokenmill.outputs import PositionLogprobs


def format_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None], num: int,
                    offset: int, tokenizer) -> tuple[dict, int]:
    """OpenAI's completions logprobs for these tokens; returns it and the text offset after them."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token, pos in zip(token_ids, positions):
        chosen = pos.get(token) if pos else None
        text = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None \
            else tokenizer.decode([token])
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if pos is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(chosen.logprob if chosen is not None else None)
        top.append({
            (lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([tid])): lp.logprob
            for tid, lp in pos.items()
            if tid == token or (lp.rank is not None and lp.rank <= num)
        })
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}, offset


async def create_completion(state, raw: Request, req: CompletionRequest):
    model = state.check_model(req.model)
    engine = state.engine
    try:
        params = req.to_sampling_params()
    except ValueError as e:
        raise from_value_error(e) from None
    try:
        prompts = [engine.process_inputs(p, params) for p in req.prompts()]
    except ValueError as e:
        raise from_value_error(e, param="prompt") from None
    request_id = s.random_id("cmpl")
    created = s.now_s()
    n = params.n
    tokenizer = engine.tokenizer
    prompt_texts = [p.text if p.text is not None else tokenizer.decode(p.token_ids) for p in prompts]
    num_prompt_tokens = sum(len(p.token_ids) for p in prompts)

    def echo_logprobs(i: int, prompt_lps) -> tuple[dict, int]:
        positions = list(prompt_lps) if prompt_lps is not None else [None] * len(prompts[i].token_ids)
        return format_logprobs(prompts[i].token_ids, positions, req.logprobs, 0, tokenizer)

    if req.stream:
        async def stream():
            offsets = [0] * (len(prompts) * n)
            started = [False] * (len(prompts) * n)
            generated = 0
            try:
                async for i, out in s.merge_generations(engine, prompts, request_id):
                    c = out.outputs[0]
                    k = i * n + c.index
                    generated += len(c.token_ids)
                    text, logprobs = c.text, None
                    if req.logprobs is not None:
                        logprobs, offsets[k] = format_logprobs(c.token_ids, c.logprobs or [], req.logprobs,
                                                               offsets[k], tokenizer)
                    if req.echo and not started[k]:
                        text = prompt_texts[i] + text
                        if req.logprobs is not None:
                            head, end = echo_logprobs(i, out.prompt_logprobs)
                            tail, offsets[k] = format_logprobs(c.token_ids, c.logprobs or [], req.logprobs,
                                                               end, tokenizer)
                            logprobs = {key: head[key] + tail[key] for key in head}
                    started[k] = True
                    if not text and not c.token_ids and c.finish_reason is None:
                        continue
                    chunk = {
                        "id": request_id, "object": "text_completion", "created": created, "model": model,
                        "choices": [{"index": k, "text": text, "logprobs": logprobs,
                                     "finish_reason": s.finish_reason(c.finish_reason),
                                     "stop_reason": c.stop_reason}],
                    }
                    if req.include_usage:
                        chunk["usage"] = None
                    yield s.sse(chunk)
                if req.include_usage:
                    yield s.sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                                 "choices": [], "usage": s.usage(num_prompt_tokens, generated)})
            except Exception as e:  # noqa: BLE001 - reported in-stream: the headers are sent
                yield s.sse_error(e)
            yield s.DONE

        return StreamingResponse(stream(), media_type="text/event-stream")

    choices = s.Choices(len(prompts), n)

    async def collect():
        async for i, out in s.merge_generations(engine, prompts, request_id):
            choices.add(i, out)

    try:
        await s.until_disconnected(raw, collect())
    except Exception as e:  # noqa: BLE001
        raise s.engine_error(e) from None
    body_choices = []
    for k in range(len(prompts) * n):
        i = k // n
        text, logprobs = choices.text[k], None
        if req.logprobs is not None:
            start = 0
            head = None
            if req.echo:
                head, start = echo_logprobs(i, choices.prompt_logprobs[i])
            logprobs, _ = format_logprobs(choices.token_ids[k], choices.logprobs[k], req.logprobs, start, tokenizer)
            if head is not None:
                logprobs = {key: head[key] + logprobs[key] for key in head}
        if req.echo:
            text = prompt_texts[i] + text
        body_choices.append({"index": k, "text": text, "logprobs": logprobs,
                             "finish_reason": s.finish_reason(choices.finish_reason[k]),
                             "stop_reason": choices.stop_reason[k]})
    return JSONResponse({
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": body_choices,
        "usage": s.usage(num_prompt_tokens, choices.num_generated, sum(choices.num_cached_tokens)),
    })
