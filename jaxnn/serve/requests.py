"""The OpenAI API's request bodies, checked: every field read and refused with the error the API returns.

Fields the API defines but jaxnn does not implement (logprobs, n > 1, penalties, tools) are refused rather than
ignored, so that a client never gets an answer computed without what it asked for.
"""

from __future__ import annotations

import dataclasses
from typing import Any


class BadRequest(ValueError):
    """A request the API refuses: HTTP `status` with OpenAI's error body (`param` names the field)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


# Fields accepted with only their default value: clients send them unasked.
_DEFAULT_ONLY = {"n": 1, "logprobs": None, "echo": False, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0,
                 "logit_bias": None, "suffix": None, "top_logprobs": None, "tools": None, "tool_choice": None,
                 "response_format": None, "parallel_tool_calls": None}  # fmt: skip
_IGNORED = {"user", "model", "stream_options", "metadata", "store", "service_tier"}
_SAMPLING = {"max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream"}
COMPLETION_FIELDS = {"prompt"} | _SAMPLING | _IGNORED | set(_DEFAULT_ONLY)
CHAT_FIELDS = {"messages", "max_completion_tokens"} | _SAMPLING | _IGNORED | set(_DEFAULT_ONLY)
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclasses.dataclass
class Sampling:
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    stop: list[str]
    seed: int | None
    stream: bool
    include_usage: bool


def check_body(body: Any, fields: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}", param=unknown[0])
    for name, default in _DEFAULT_ONLY.items():
        if body.get(name, default) not in (default, None) and not (name == "n" and body.get(name) == 1):
            raise BadRequest(f"{name}={body[name]!r} is not supported by this server (only {default!r})", param=name)
    return body


def sampling(body: dict[str, Any], max_tokens_field: str = "max_tokens") -> Sampling:
    """The sampling fields of a completion or chat request, each checked against the API's ranges."""
    max_tokens = body.get(max_tokens_field, body.get("max_tokens"))
    if max_tokens is not None and not (_is_int(max_tokens) and max_tokens >= 1):
        raise BadRequest(f"{max_tokens_field} must be an integer >= 1, got {max_tokens!r}", param=max_tokens_field)
    temperature = _number(body, "temperature", 1.0, 0, 2)
    top_p = _number(body, "top_p", 1.0, 0, 1, open_low=True)
    top_k = body.get("top_k", -1)
    if top_k is None:
        top_k = -1
    if not (_is_int(top_k) and (top_k == -1 or top_k >= 1)):
        raise BadRequest(f"top_k must be -1 (off) or an integer >= 1, got {top_k!r}", param="top_k")
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed < 2**32):
        raise BadRequest(f"seed must be an integer in [0, 2**32), got {seed!r}", param="seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise BadRequest('stream_options must be an object like {"include_usage": true}', param="stream_options")
    return Sampling(max_tokens, temperature, top_p, 0 if top_k == -1 else top_k, _stops(body.get("stop")), seed,
                    stream, bool(options.get("include_usage", False)))  # fmt: skip


def completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """The prompts of a completion request: text, a list of texts, token ids, or a list of id lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt)
    ):
        return [list(p) for p in prompt]
    raise BadRequest("prompt must be a string, a list of strings, or token ids (a list of integers, or of lists)",
                     param="prompt")  # fmt: skip


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages of a chat request, with text content (a string, or a list of {"type": "text"} parts)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest('messages must be a non-empty list of {"role", "content"} objects', param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}] must be an object with a role among {', '.join(ROLES)}",
                             param=f"messages[{i}]")  # fmt: skip
        content = message.get("content")
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise BadRequest(
                    f"messages[{i}].content: only text parts are supported", param=f"messages[{i}].content"
                )
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be text", param=f"messages[{i}].content")
        out.append({**{k: v for k, v in message.items() if k in ("role", "name")}, "content": content})
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, name: str, default: float, low: float, high: float, open_low: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    ok = ok and (low < value if open_low else low <= value) and value <= high
    if not ok:
        interval = f"{'(' if open_low else '['}{low}, {high}]"
        raise BadRequest(f"{name} must be a number in {interval}, got {value!r}", param=name)
    return float(value)


def _stops(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and len(stops) <= 4 and all(isinstance(s, str) and s for s in stops)):
        raise BadRequest("stop must be a non-empty string or a list of at most 4 of them", param="stop")
    return stops
