"""The OpenAI-compatible HTTP API of `lora-lab serve` (FastAPI): /v1/models,
/v1/chat/completions and /v1/completions, streamed (server-sent events ending with
`data: [DONE]`) or not. Every failure answers OpenAI's error shape
{"error": {"message", "type", "param", "code"}}, never a traceback."""

from __future__ import annotations

import hmac
import json
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from ..log import get_logger
from .serve import Generation, Sampling, Served, ServedModels, generate, stream

log = get_logger()


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _error(status: int, message: str, type_: str, param=None, code=None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1)

    def sampling(self, default_max: int | None = None) -> Sampling:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4:
            raise APIError(400, "stop: at most 4 sequences.", "invalid_request_error", "stop")
        max_tokens = self.max_tokens or default_max or 256
        return Sampling(max_tokens, self.temperature, self.top_p, self.seed, stop)


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Request):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None


class CompletionRequest(_Request):
    prompt: str | list[str]


def _text_of(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "messages: only text content parts are served.", "invalid_request_error", "messages")
        texts.append(part["text"])
    return "".join(texts)


def _messages(request: ChatRequest) -> list[dict]:
    out = []
    for message in request.messages:
        row = message.model_dump(exclude_none=True)
        row["role"] = "system" if message.role == "developer" else message.role
        row["content"] = _text_of(message.content)
        out.append(row)
    return out


def build_app(served: ServedModels, api_key: str | None = None) -> FastAPI:
    """The API over loaded models; with api_key, every /v1 route asks for `Authorization: Bearer KEY`."""
    app = FastAPI(title="lora-lab serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    def api_error(_request, exc: APIError):
        return _error(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    def invalid(_request, exc: RequestValidationError):
        first = exc.errors()[0]
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return _error(400, f"the request body is not valid JSON: {first.get('msg')}", "invalid_request_error")
        param = ".".join(where) or None
        return _error(400, f"{param or 'body'}: {first.get('msg')}", "invalid_request_error", param)

    @app.exception_handler(HTTPException)
    def http_error(_request, exc: HTTPException):
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    def unexpected(_request, exc: Exception):
        log.error(f"serve: {type(exc).__name__}: {exc}")
        return _error(500, f"the server failed to answer: {type(exc).__name__}: {exc}", "server_error")

    @app.middleware("http")
    async def authorise(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1"):
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
                return _error(
                    401,
                    "missing or wrong API key: send `Authorization: Bearer KEY`.",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
        return await call_next(request)

    def entry_of(name: str) -> Served:
        entry = served.get(name)
        if entry is None:
            raise APIError(
                404,
                f"The model `{name}` does not exist. Served: {', '.join(served.entries)}.",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return entry

    def check_length(prompt_ids: list[int], sampling: Sampling) -> None:
        if served.max_length and len(prompt_ids) + sampling.max_tokens > served.max_length:
            raise APIError(
                400,
                f"This model's maximum context length is {served.max_length} tokens; the prompt has "
                f"{len(prompt_ids)} and max_tokens asks for {sampling.max_tokens} more.",
                "invalid_request_error",
                "messages",
                "context_length_exceeded",
            )

    @app.get("/v1/models")
    def models():
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "lora-lab", "root": entry.source or name}
            for name, entry in served.entries.items()
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    def chat(request: ChatRequest):
        entry = entry_of(request.model)
        sampling = request.sampling(request.max_completion_tokens)
        try:
            text = entry.tokenizer.apply_chat_template(
                _messages(request), tools=request.tools, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # a jinja TemplateError: the template refuses these messages
            raise APIError(400, f"messages: the chat template refused them: {exc}", "invalid_request_error") from None
        prompt_ids = entry.tokenizer(text, add_special_tokens=False)["input_ids"]
        check_length(prompt_ids, sampling)
        return _answer(served, entry, prompt_ids, sampling, request.stream, chat=True)

    @app.post("/v1/completions")
    def completions(request: CompletionRequest):
        entry = entry_of(request.model)
        sampling = request.sampling(16)
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        if len(prompts) != 1:
            raise APIError(400, "prompt: one prompt per request is served.", "invalid_request_error", "prompt")
        prompt_ids = entry.tokenizer(prompts[0])["input_ids"]
        check_length(prompt_ids, sampling)
        return _answer(served, entry, prompt_ids, sampling, request.stream, chat=False)

    return app


def _answer(
    served: ServedModels, entry: Served, prompt_ids: list[int], sampling: Sampling, streamed: bool, chat: bool
):
    ident, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
    head = {
        "id": ident,
        "object": ("chat.completion" if chat else "text_completion") + (".chunk" if streamed and chat else ""),
        "created": created,
        "model": entry.name,
    }
    if not streamed:
        result = generate(served, entry, prompt_ids, sampling)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text}}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None}
        choice["finish_reason"] = result.finish_reason
        return {**head, "choices": [choice], "usage": _usage(result)}

    def piece(text: str | None, finish: str | None = None, first: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return f"data: {json.dumps({**head, 'choices': [choice]}, ensure_ascii=False)}\n\n"

    def events():
        if chat:
            yield piece(None, first=True)
        try:
            for item in stream(served, entry, prompt_ids, sampling):
                if isinstance(item, Generation):
                    yield piece(None, item.finish_reason)
                else:
                    yield piece(item)
        except Exception as exc:  # mid-stream: the status is sent already; say it in the stream
            log.error(f"serve: {type(exc).__name__}: {exc}")
            error = {"message": f"generation failed: {type(exc).__name__}: {exc}", "type": "server_error"}
            yield f"data: {json.dumps({'error': {**error, 'param': None, 'code': None}})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _usage(result: Generation) -> dict:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }
