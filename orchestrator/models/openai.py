"""The Chat Completions wire (``openai.AsyncOpenAI``) and the endpoints that speak it:
``openai/ID`` (OPENAI_API_KEY, OPENAI_BASE_URL), ``openrouter/ID`` (OPENROUTER_API_KEY,
OPENROUTER_BASE_URL; an id such as ``anthropic/claude-sonnet-4.5`` is sent whole) and any
``[endpoints.NAME]`` with ``wire = "openai"`` (a local vLLM or Ollama server...).

The agent loop's Anthropic-shaped conversation is converted both ways here: the system
prompt is the first message (its stable part first: the API caches prefixes by itself),
each ``tool_result`` a ``role: tool`` message, a tool call's ``arguments`` parsed (invalid
JSON stays the raw string: the loop answers it with a tool error); usage counts cached
prompt tokens as cache reads. Each endpoint's client is built with that endpoint's key
explicitly; for any but OpenAI's own API, what the SDK read of its own variables
(organization, project, admin key, custom headers) is dropped, so nothing of one endpoint
reaches another. The SDK (an optional extra: ``pip install 'orch[openai]'``) is imported
when the first model is built; its own retries (429, 5xx, dropped connections) apply.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from .base import (
    Block,
    ContextOverflow,
    Message,
    Model,
    ModelError,
    ModelRequest,
    ModelResponse,
    ModelUsage,
    clean_text,
)
from .registry import ApiEnv, Provider, Session, Target

if TYPE_CHECKING:
    import openai

API = ApiEnv(
    title="the OpenAI API",
    credentials=("OPENAI_API_KEY",),
    base_url="OPENAI_BASE_URL",
    default_url="https://api.openai.com/v1",
)
OPENROUTER_API = ApiEnv(
    title="OpenRouter",
    credentials=("OPENROUTER_API_KEY",),
    base_url="OPENROUTER_BASE_URL",
    default_url="https://openrouter.ai/api/v1",
)
NO_SDK = "the Chat Completions wire needs the openai package: pip install 'orch[openai]'"
MAX_RETRIES = 4
STOP_REASONS = {
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "length": "max_tokens",
    "stop": "end_turn",
    "content_filter": "refusal",
}


def missing_sdk() -> str | None:
    return None if importlib.util.find_spec("openai") is not None else NO_SDK


class ChatProvider:
    """A Chat Completions service whose settings are environment variables (``api``)."""

    whole_run = False
    preload = (__name__, "openai", "genai_prices")  # its SDK, and the price table

    def __init__(self, name: str, api: ApiEnv, env_prefix: str) -> None:
        self.name = name
        self.api = api
        self.env_prefix = env_prefix
        self.env_names = api.names

    def portable(self, model_id: str) -> str:
        return model_id

    def fixed(self, model_id: str) -> Model | None:
        return None

    def missing_sdk(self) -> str | None:
        return missing_sdk()

    def missing(self) -> str | None:
        api = self.api
        if not any(os.environ.get(n) for n in api.names):
            return (
                f"no key for {self.name}/ models: set {api.credentials[0]} (or {api.base_url} "
                "for a compatible server)"
            )
        return missing_sdk()

    def target(self) -> Target:
        api = self.api
        return Target(
            title=api.title,
            base_url=(os.environ.get(api.base_url) or "").strip() or api.default_url,
            key=os.environ.get(api.credentials[0], ""),
            key_name=api.credentials[0],
            url_name=api.base_url,
            own_env=self is PROVIDER,
            missing=self.missing(),
        )

    def open(self) -> Session:
        return open_target(self.target())


PROVIDER: Provider = ChatProvider("openai", API, "OPENAI_")
OPENROUTER: Provider = ChatProvider("openrouter", OPENROUTER_API, "OPENROUTER_")


def open_target(target: Target) -> ChatSession:
    return ChatSession(target)


def make_client(target: Target) -> openai.AsyncOpenAI:
    try:
        import openai
    except ImportError:
        raise UsageError(NO_SDK) from None
    client = openai.AsyncOpenAI(
        api_key=target.key or "orch-no-key",  # explicit: the SDK never reads another's
        base_url=target.base_url,
        max_retries=MAX_RETRIES,
    )
    if not target.own_env:  # what the SDK read of OpenAI's own variables is not this one's
        client.organization = None
        client.project = None
        for name in ("admin_api_key", "webhook_secret"):
            if hasattr(client, name):
                setattr(client, name, None)
        if os.environ.get("OPENAI_CUSTOM_HEADERS") is not None:
            client._custom_headers = {}  # noqa: SLF001 (OPENAI_CUSTOM_HEADERS: OpenAI's)
    return client


class ChatSession:
    """One SDK client (its connection pool) for every model of one endpoint."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self._client: openai.AsyncOpenAI | None = None

    def model(self, model_id: str) -> Model:
        if self._client is None and self.target.missing is None:
            self._client = make_client(self.target)
        return ChatModel(self._client, model_id, self.target)

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()


# -- the request ----------------------------------------------------------------------------


def _text(content: Any) -> str:
    """A tool result's or message's content as one text (text blocks joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [_text(b.get("text", "")) if _is(b, "text") else _other(b) for b in content]
        return "\n\n".join(p for p in parts if p)
    return "" if content is None else _other(content)


def _other(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str, ensure_ascii=False)


def _is(block: Any, kind: str) -> bool:
    return isinstance(block, dict) and block.get("type") == kind


def _arguments(value: Any) -> str:
    """A tool_use's input as Chat Completions' ``arguments``: a string stays as sent."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _assistant(content: Any) -> Message:
    blocks = content if isinstance(content, list) else [{"type": "text", "text": _text(content)}]
    text = "\n\n".join(t for b in blocks if _is(b, "text") and (t := _text(b.get("text"))))
    calls = [
        {
            "id": str(b.get("id", "")),
            "type": "function",
            "function": {"name": str(b.get("name", "")), "arguments": _arguments(b.get("input"))},
        }
        for b in blocks
        if _is(b, "tool_use")
    ]
    message: Message = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    elif not text:
        message["content"] = ""
    return message


def _user(content: Any) -> list[Message]:
    """A user turn: each tool_result a ``tool`` message, in order, then its other text."""
    if not isinstance(content, list):
        return [{"role": "user", "content": _text(content)}]
    out: list[Message] = []
    rest: list[Any] = []
    for block in content:
        if _is(block, "tool_result"):
            text = _text(block.get("content"))
            if block.get("is_error"):
                text = f"[tool error] {text}"
            out.append(
                {"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": text}
            )
        else:
            rest.append(block)
    if rest or not out:
        out.append({"role": "user", "content": _text(rest)})
    return out


def messages(request: ModelRequest) -> list[Message]:
    """The request's system prompt and conversation as Chat Completions messages."""
    out: list[Message] = []
    if request.system:
        out.append({"role": "system", "content": request.system})
    for message in request.messages:
        if message.get("role") == "assistant":
            out.append(_assistant(message.get("content")))
        else:
            out.extend(_user(message.get("content")))
    return out


def tools(request: ModelRequest) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": t.get("name", ""),
                "description": t.get("description", ""),
                "parameters": t.get("input_schema") or {"type": "object", "properties": {}},
            },
        }
        for t in request.tools
    ]


def body(request: ModelRequest, model_id: str, official: bool = False) -> dict[str, Any]:
    """The ``chat.completions.create`` arguments. OpenAI's own API takes the output limit
    as ``max_completion_tokens`` (its reasoning models refuse ``max_tokens``) and a
    ``prompt_cache_key`` (the stable prefix's digest: the runs of one agent reach the same
    cache); a compatible server gets ``max_tokens`` and nothing it may not know. Parallel
    tool calls are the APIs' default: allowed."""
    out: dict[str, Any] = {"model": model_id, "messages": messages(request)}
    if request.tools:
        out["tools"] = tools(request)
    out["max_completion_tokens" if official else "max_tokens"] = request.max_tokens
    stable = request.system[: max(0, request.stable_chars)]
    if official and stable:
        out["prompt_cache_key"] = "orch-" + hashlib.sha256(stable.encode()).hexdigest()[:24]
    return out


# -- the response ---------------------------------------------------------------------------


def _get(value: Any, name: str) -> Any:
    return value.get(name) if isinstance(value, dict) else getattr(value, name, None)


def _count(value: Any, name: str) -> int:
    found = _get(value, name)
    return found if isinstance(found, int) and not isinstance(found, bool) and found > 0 else 0


def _input(arguments: Any) -> Any:
    """A tool call's input: its JSON ``arguments`` parsed, else as sent (the loop answers a
    string or anything not an object with a tool error); none at all is ``{}``."""
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def usage(found: Any) -> ModelUsage:
    """Chat Completions' usage as the seam counts it: cached prompt tokens are cache reads,
    the rest of the prompt is input."""
    prompt = _count(found, "prompt_tokens")
    cached = min(prompt, _count(_get(found, "prompt_tokens_details"), "cached_tokens"))
    return ModelUsage(
        input_tokens=prompt - cached,
        output_tokens=_count(found, "completion_tokens"),
        cache_read_input_tokens=cached,
    )


def response(completion: Any) -> ModelResponse:
    """A chat completion as the seam's response (its first choice)."""
    choices = _get(completion, "choices")
    if not isinstance(choices, list) or not choices:
        error = _get(completion, "error")
        why = _get(error, "message") if error is not None else None
        raise ModelError(clean_text(f"model API error: no choice in the answer ({why or 'empty'})"))
    choice = choices[0]
    message = _get(choice, "message")
    content: list[Block] = []
    text = _get(message, "content")
    if not isinstance(text, str) or not text:
        text = _get(message, "refusal")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    calls = _get(message, "tool_calls")
    for call in calls if isinstance(calls, list) else []:
        function = _get(call, "function")
        block: Block = {"type": "tool_use"}
        if (call_id := _get(call, "id")) is not None:
            block["id"] = call_id
        if (name := _get(function, "name")) is not None:
            block["name"] = name
        block["input"] = _input(_get(function, "arguments"))
        content.append(block)
    finish = _get(choice, "finish_reason")
    stop = STOP_REASONS.get(finish, "end_turn") if isinstance(finish, str) else "end_turn"
    if stop == "end_turn" and any(b["type"] == "tool_use" for b in content):
        stop = "tool_use"
    return ModelResponse(content=content, stop_reason=stop, usage=usage(_get(completion, "usage")))


# -- the call ----------------------------------------------------------------------------------

_OVERFLOW = re.compile(r"context[ _]length", re.I)  # "maximum context length", the code


def _one_line(text: str, key: str) -> str:
    """``text`` as one line without the endpoint's key (a server may echo it)."""
    if key:
        text = text.replace(key, "[key]")
    return clean_text(" ".join(text.split()))


class ChatModel:
    def __init__(self, client: openai.AsyncOpenAI | None, model_id: str, target: Target) -> None:
        self.client = client
        self.model_id = model_id
        self.target = target

    async def complete(self, request: ModelRequest) -> ModelResponse:
        target = self.target
        if self.client is None:
            raise ModelError(target.missing or NO_SDK)
        import openai

        official = target.own_env and target.base_url == API.default_url
        try:
            completion = await self.client.chat.completions.create(
                **body(request, self.model_id, official)
            )
        except openai.AuthenticationError as e:
            raise ModelError(
                f"{target.title} rejected the credentials (401); check {target.key_name}"
            ) from e
        except openai.APIStatusError as e:
            error = e.body if isinstance(e.body, dict) else {}
            error = error.get("error", error) if isinstance(error.get("error"), dict) else error
            said = error.get("message") if isinstance(error.get("message"), str) else e.message
            text = _one_line(f"model API error {e.status_code}: {said}", target.key)
            code = str(error.get("code") or getattr(e, "code", None) or "")
            if code == "context_length_exceeded" or (
                e.status_code in (400, 413) and _OVERFLOW.search(str(said))
            ):
                raise ContextOverflow(text) from e
            raise ModelError(text) from e
        except openai.APIConnectionError as e:
            raise ModelError(
                _one_line(
                    f"cannot reach {target.title} ({e}); check {target.url_name} and the network",
                    target.key,
                )
            ) from e
        except openai.OpenAIError as e:  # a response the SDK could not read
            raise ModelError(_one_line(f"model API error: {e}", target.key)) from e
        return response(completion)
