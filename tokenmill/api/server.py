"""The OpenAI-compatible HTTP server: the FastAPI app factory and `tokenmill serve`.

Life cycle (run_server):
  1. bind the port (a busy port fails at once), load the tokenizer (a bad model path fails at once),
     start the engine core (its own process; a model that fails to load fails with its one-line reason);
  2. serve; print "tokenmill: serving MODEL on http://HOST:PORT" once uvicorn listens;
  3. SIGTERM/SIGINT: drain. New requests get 503, in-flight ones have TOKENMILL_SHUTDOWN_GRACE_S to
     finish (then they are ended with an error), exit 0. A second SIGINT forces the exit;
  4. engine death: /health and new requests get 503, in-flight requests end with an error, and the
     server exits 1 (after a short linger so that health checks can see the 503).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import socket
import sys
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

import tokenmill
from tokenmill import envs
from tokenmill.api.chat import create_chat_completion
from tokenmill.api.completions import create_completion
from tokenmill.api.errors import APIError, bad_request, from_validation_error, install_error_handlers, \
    model_not_found, unavailable
from tokenmill.api.metrics import CONTENT_TYPE, Metrics
from tokenmill.api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tokenmill.engine.async_llm import AsyncLLM

logger = logging.getLogger("tokenmill.api")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# After the engine died: how long /health keeps answering 503 before the server exits (at most).
DEAD_LINGER_S = 2.0
_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_PUBLIC_PATHS = ("/health", "/version", "/metrics", "/ping")


@dataclass
class ServerSettings:
    served_model_names: list[str]
    api_key: str | None = None
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


class ServerState:
    def __init__(self, engine: AsyncLLM, settings: ServerSettings, metrics: Metrics):
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.draining = False
        self.inflight = 0
        self.exit_code = 0
        self.started_at = int(time.time())

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    def check_model(self, model: str | None) -> str:
        if model is None or model == "":
            return self.model_name
        if model not in self.settings.served_model_names:
            raise model_not_found(model)
        return model

    def unavailable_reason(self) -> str | None:
        if self.engine.errored:
            return f"the engine is dead: {self.engine.dead_reason}"
        if self.draining:
            return "the server is shutting down"
        return None


class _GuardMiddleware:
    """API key, 503 while dead or draining, and the count of in-flight generations (pure ASGI, so
    streaming responses and client disconnects pass through untouched)."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, state = scope["path"], self.state
        key = state.settings.api_key
        if key is not None and scope.get("method") != "OPTIONS" and path not in _PUBLIC_PATHS:
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(auth.encode("latin-1"), f"Bearer {key}".encode("latin-1")):
                message = "missing API key (Authorization: Bearer ...)" if not auth else "invalid API key"
                return await APIError(401, message, code="invalid_api_key").response()(scope, receive, send)
        if path in _GENERATION_PATHS or path in ("/tokenize", "/detokenize"):
            reason = state.unavailable_reason()
            if reason is not None:
                return await unavailable(reason).response()(scope, receive, send)
        if path not in _GENERATION_PATHS:
            return await self.app(scope, receive, send)
        state.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.inflight -= 1


async def _parse(request: Request, model: type[BaseModel]):
    body = await request.body()
    try:
        return model.model_validate_json(body or b"")
    except ValidationError as e:
        raise from_validation_error(e) from None


def build_app(engine: AsyncLLM, settings: ServerSettings, metrics: Metrics | None = None) -> FastAPI:
    metrics = metrics or Metrics(settings.served_model_names[0])
    state = ServerState(engine, settings, metrics)
    app = FastAPI(title="tokenmill", version=tokenmill.__version__)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(_GuardMiddleware, state=state)
    app.add_middleware(
        CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=settings.allowed_methods,
        allow_headers=settings.allowed_headers, allow_credentials=settings.allow_credentials,
    )

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await create_completion(state, request, await _parse(request, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await create_chat_completion(state, request, await _parse(request, ChatCompletionRequest))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": state.started_at, "owned_by": "tokenmill",
             "root": engine.model.source, "parent": None, "max_model_len": engine.max_model_len,
             "quantization": engine.config.quantization}
            for name in settings.served_model_names
        ]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await _parse(request, TokenizeRequest)
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", param="prompt")
        try:
            if req.prompt is not None:
                ids = list(engine.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids)
            else:
                text = engine.processor.render_chat([m.to_template_dict() for m in req.messages],
                                                    req.add_generation_prompt)
                ids = engine.processor.tokenize_chat(text)
        except ValueError as e:
            raise bad_request(str(e), param="messages" if req.messages is not None else "prompt") from None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await _parse(request, DetokenizeRequest)
        state.check_model(req.model)
        vocab = engine.model.config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of vocabulary (size {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    @app.get("/health")
    async def health():
        reason = state.unavailable_reason()
        if reason is not None:
            return unavailable(reason).response()
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": tokenmill.__version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(await metrics.render(engine), media_type=CONTENT_TYPE)

    return app


# ---- tokenmill serve ------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains instead of stopping, and no signal is re-raised."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.draining and sig == signal.SIGINT:
            self.force_exit = True
            self.should_exit = True
        self.state.draining = True


async def _lifecycle(server: _Server, state: ServerState, url: str) -> None:
    engine = state.engine
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(0.05)
    print(f"tokenmill: serving {state.model_name} on {url}", flush=True)
    grace = envs.TOKENMILL_SHUTDOWN_GRACE_S
    dead_since = drain_deadline = None
    while not server.should_exit:
        await asyncio.sleep(0.05)
        now = time.monotonic()
        if engine.errored:
            if dead_since is None:
                dead_since, state.exit_code = now, 1
                logger.error("the engine core is dead (%s); exiting", engine.dead_reason)
            if now - dead_since >= DEAD_LINGER_S:
                server.should_exit = True
        elif state.draining:
            if drain_deadline is None:
                drain_deadline = now + grace
                logger.info("draining: %d request(s) in flight, %.0f s grace", state.inflight, grace)
            if state.inflight == 0:
                server.should_exit = True
            elif now > drain_deadline:
                logger.warning("grace period over: ending %d request(s)", state.inflight)
                engine.fail_all("the server is shutting down")
                await asyncio.sleep(0.5)
                server.should_exit = True


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


async def serve(args) -> int:
    """`tokenmill serve`: returns the exit code (0 after a clean shutdown, 1 if the engine died)."""
    sock = _bind(args.host, args.port)
    try:
        names = args.served_model_name or [args.model if args.model else DEFAULT_MODEL_NAME]
        metrics = Metrics(names[0])
        engine_args = dict(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                           dtype=args.dtype, seed=args.seed, enable_prefix_caching=args.enable_prefix_caching,
                           async_scheduling=args.async_scheduling, kv_cache_dtype=args.kv_cache_dtype)
        if args.kv_cache_memory is not None:
            engine_args["kv_cache_memory"] = args.kv_cache_memory
        engine_args.update(tensor_parallel_size=args.tensor_parallel_size,
                           enable_expert_parallel=args.enable_expert_parallel)
        engine_args.update(data_parallel_size=args.data_parallel_size, data_parallel_backend=args.data_parallel_backend)
        engine_args["distributed_executor_backend"] = args.distributed_executor_backend
        if args.quantization is not None:
            engine_args["quantization"] = args.quantization
        if args.speculative_config is not None:
            engine_args["speculative_config"] = args.speculative_config
        if args.expert_quantization is not None:
            engine_args.update(expert_quantization=args.expert_quantization,
                               expert_quantization_window=args.expert_quantization_window)
        engine = AsyncLLM.from_engine_args(args.model, stat_logger=metrics, **engine_args)
    except BaseException:
        sock.close()
        raise
    try:
        settings = ServerSettings(
            served_model_names=names, api_key=args.api_key, allowed_origins=args.allowed_origins,
            allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers,
            allow_credentials=args.allow_credentials,
        )
        app = build_app(engine, settings, metrics)
        state: ServerState = app.state.server
        config = uvicorn.Config(app, log_level=args.uvicorn_log_level, access_log=not args.disable_access_log,
                                timeout_graceful_shutdown=5, timeout_keep_alive=5, lifespan="off")
        server = _Server(config, state)
        host, port = sock.getsockname()[:2]
        url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        watcher = asyncio.create_task(_lifecycle(server, state, url))
        await server.serve(sockets=[sock])
        watcher.cancel()
        if state.exit_code:
            print(f"tokenmill: error: {engine.dead_reason}", file=sys.stderr, flush=True)
        return state.exit_code
    finally:
        engine.shutdown()
        sock.close()


def run_server(args) -> int:
    return asyncio.run(serve(args))
