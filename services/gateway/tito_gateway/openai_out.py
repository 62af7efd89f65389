"""Derender's ChatChunks -> OpenAI's response shapes (whole and streamed, chat and completions).

Domain code: no HTTP here. Field names, chunk shapes, finish reasons and usage follow OpenAI's API
reference; reasoning goes in the message/delta field `reasoning`, as vLLM 0.32 returns it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tito.v1 import derender_pb2, engine_pb2

FINISH_REASONS = {
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
    engine_pb2.FINISH_REASON_ABORT: "abort",
}


def finish_reason(chunk: derender_pb2.ChatChunk) -> str | None:
    return FINISH_REASONS.get(chunk.finish_reason)


def usage_json(usage: engine_pb2.Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _top(alternative) -> dict:
    return {"token": alternative.token, "logprob": alternative.logprob, "bytes": list(alternative.bytes)}


def chat_logprobs(entries) -> list[dict]:
    return [{**_top(entry), "top_logprobs": [_top(alt) for alt in entry.top_logprobs]} for entry in entries]


def tool_call_delta(call: derender_pb2.ToolCallDelta) -> dict:
    delta: dict = {"index": call.index}
    if call.id:
        delta["id"] = call.id
    if call.type:
        delta["type"] = call.type
    function: dict = {}
    if call.name:
        function["name"] = call.name
    if call.arguments or call.name:
        function["arguments"] = call.arguments
    delta["function"] = function
    return delta


def continuous_usage_json(usage: engine_pb2.Usage | None) -> dict | None:
    """A streamed chunk's own usage (stream_options.continuous_usage_stats), in vLLM's fields."""
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


class UsageTracker:
    """The request's usage. Derender's final chunks carry their stream's total over its choices
    finished so far; a completion with several prompts has one stream per prompt (choice i belongs
    to prompt i // choices_per_prompt, as merge numbers them), so the request's usage is the sum of
    each prompt's latest total."""

    def __init__(self, choices_per_prompt: int | None = None) -> None:
        self.choices_per_prompt = choices_per_prompt  # None: one prompt
        self.usage = engine_pb2.Usage()
        self._prompts: dict[int, engine_pb2.Usage] = {}

    def add(self, chunk: derender_pb2.ChatChunk) -> engine_pb2.Usage | None:
        """Take the chunk's usage; return the chunk's own (continuous usage stats): the prompt's
        tokens and its choice's so far. Derender sends that in a chunk that does not end its choice
        (when asked); a final chunk's own is what its choice added to its prompt's total."""
        if not chunk.HasField("usage"):
            return None
        if not chunk.finish_reason:
            return chunk.usage
        prompt = 0 if self.choices_per_prompt is None else chunk.index // self.choices_per_prompt
        before = self._prompts.get(prompt, engine_pb2.Usage())
        own = engine_pb2.Usage(prompt_tokens=chunk.usage.prompt_tokens,
                               completion_tokens=chunk.usage.completion_tokens - before.completion_tokens)
        self._prompts[prompt] = chunk.usage
        totals = self._prompts.values()
        self.usage = engine_pb2.Usage(prompt_tokens=sum(u.prompt_tokens for u in totals),
                                      completion_tokens=sum(u.completion_tokens for u in totals),
                                      cached_tokens=sum(u.cached_tokens for u in totals))
        return own


@dataclass
class Choice:
    """One choice's output, assembled from its chunks."""

    index: int
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict] = field(default_factory=dict)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, chunk: derender_pb2.ChatChunk) -> None:
        if chunk.content:
            self.content.append(chunk.content)
        if chunk.reasoning_content:
            self.reasoning.append(chunk.reasoning_content)
        for call in chunk.tool_calls:
            entry = self.tool_calls.setdefault(call.index, {"id": "", "type": "function",
                                                            "function": {"name": "", "arguments": ""}})
            if call.id:
                entry["id"] = call.id
            if call.name:
                entry["function"]["name"] += call.name
            entry["function"]["arguments"] += call.arguments
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason:
            self.finish_reason = finish_reason(chunk)


class Assembled:
    """A whole response collected from the stream of chunks (all choices)."""

    def __init__(self, choices_per_prompt: int | None = None) -> None:
        self.choices: dict[int, Choice] = {}
        self.usage = UsageTracker(choices_per_prompt)

    def add(self, chunk: derender_pb2.ChatChunk) -> None:
        self.choices.setdefault(chunk.index, Choice(chunk.index)).add(chunk)
        self.usage.add(chunk)

    def sorted(self) -> list[Choice]:
        return [self.choices[index] for index in sorted(self.choices)]


def chat_completion(response_id: str, model: str, assembled: Assembled, logprobs: bool,
                    created: int | None = None, echo: str | None = None, role: str = "assistant") -> dict:
    """`echo`: the text each choice's content starts with (vLLM's chat `echo`; "" when echo is on
    with nothing to echo: the content is then a string even beside tool calls, as vLLM's is).
    `role`: the answer's (openai_in.answer_role)."""
    choices = []
    for choice in assembled.sorted():
        content = (echo or "") + "".join(choice.content)
        keep = content or echo is not None or not choice.tool_calls
        message: dict = {"role": role, "content": content if keep else None}
        if choice.reasoning:
            message["reasoning"] = "".join(choice.reasoning)
        if choice.tool_calls:
            message["tool_calls"] = [choice.tool_calls[i] for i in sorted(choice.tool_calls)]
        choices.append({"index": choice.index, "message": message,
                        "logprobs": {"content": chat_logprobs(choice.logprobs)} if logprobs else None,
                        "finish_reason": choice.finish_reason})
    return {"id": response_id, "object": "chat.completion", "created": created or int(time.time()), "model": model,
            "choices": choices, "usage": usage_json(assembled.usage.usage)}


@dataclass(frozen=True)
class StreamUsage:
    """Where a stream reports usage: include_usage, a usage chunk at the end; continuous (vLLM's
    continuous_usage_stats, with include_usage), each chunk's own usage as well."""

    include_usage: bool = False
    continuous: bool = False


def stream_event(head: dict, choice: dict, options: StreamUsage, own: engine_pb2.Usage | None = None) -> dict:
    """One streamed chunk holding `choice`. With include_usage its `usage` is null (the usage chunk
    comes last), or with continuous usage stats the chunk's own usage (`own`)."""
    out = {**head, "choices": [choice]}
    if options.include_usage:
        out["usage"] = continuous_usage_json(own) if options.continuous else None
    return out


class ChatStream:
    """Chat completion chunks (`chat.completion.chunk`) for one streamed request."""

    def __init__(self, response_id: str, model: str, usage: StreamUsage, logprobs: bool, role: str = "assistant"):
        """`role`: the answer's (openai_in.answer_role), in each choice's first chunk."""
        self.head = {"id": response_id, "object": "chat.completion.chunk", "created": int(time.time()),
                     "model": model}
        self.role = role
        self.options = usage
        self.logprobs = logprobs
        self.usage = UsageTracker()
        self.announced = 0  # choices 0..announced-1 had their role chunk (`roles`)

    def roles(self, n: int, prompt_tokens: int = 0, echo: str | None = None) -> list[dict]:
        """Each choice's first chunk, its role with content "" (as OpenAI's and vLLM's streams
        begin); derender's chunks then carry no role. `prompt_tokens`: their usage, with
        continuous usage stats (no token generated yet). `echo`: then a chunk per choice with
        that text (vLLM's chat `echo`, sent where vLLM sends it)."""
        self.announced = n
        own = engine_pb2.Usage(prompt_tokens=prompt_tokens)
        deltas = [{"role": self.role, "content": ""}] + ([{"content": echo}] if echo else [])
        return [stream_event(self.head, {"index": index, "delta": delta, "logprobs": None, "finish_reason": None},
                             self.options, own)
                for delta in deltas for index in range(n)]

    def chunk(self, chunk: derender_pb2.ChatChunk) -> dict | None:
        """The OpenAI chunk for one derender chunk (None when it carries nothing to say)."""
        own = self.usage.add(chunk)
        delta: dict = {}
        role = self.role if chunk.role and chunk.index >= self.announced else ""
        if role:
            delta["role"] = role
        if chunk.content or (role and not chunk.reasoning_content and not chunk.tool_calls):
            delta["content"] = chunk.content
        if chunk.reasoning_content:
            delta["reasoning"] = chunk.reasoning_content
        if chunk.tool_calls:
            delta["tool_calls"] = [tool_call_delta(call) for call in chunk.tool_calls]
        reason = finish_reason(chunk)
        if not delta and reason is None and not chunk.logprobs:
            return None
        return stream_event(self.head, {
            "index": chunk.index, "delta": delta,
            "logprobs": {"content": chat_logprobs(chunk.logprobs)} if self.logprobs and chunk.logprobs else None,
            "finish_reason": reason}, self.options, own)

    def final(self) -> dict | None:
        """The usage chunk after the last choice (stream_options.include_usage), else None."""
        if not self.options.include_usage:
            return None
        return {**self.head, "choices": [], "usage": usage_json(self.usage.usage)}


# -- completions --------------------------------------------------------------------------------

def completion_logprobs(entries, text_offset: int) -> dict:
    """The legacy Completions logprobs object for `entries` (offsets counted from `text_offset`)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset
    for entry in entries:
        tokens.append(entry.token)
        token_logprobs.append(entry.logprob)
        top.append({alt.token: alt.logprob for alt in entry.top_logprobs})
        offsets.append(offset)
        offset += len(entry.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


class Echo:
    """Completions' `echo`: each choice's text starts with its prompt's text (choice i belongs to
    prompt i // n, as merge numbers them)."""

    def __init__(self, prompt_texts: list[str], n: int) -> None:
        self.prompt_texts = prompt_texts
        self.n = n

    def text(self, index: int) -> str:
        return self.prompt_texts[index // self.n]


def text_completion(response_id: str, model: str, assembled: Assembled, logprobs: bool,
                    echo: Echo | None = None) -> dict:
    choices = [{"index": choice.index,
                "text": (echo.text(choice.index) if echo is not None else "") + "".join(choice.content),
                "logprobs": completion_logprobs(choice.logprobs, 0) if logprobs else None,
                "finish_reason": choice.finish_reason}
               for choice in assembled.sorted()]
    return {"id": response_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage_json(assembled.usage.usage)}


class CompletionStream:
    """`text_completion` chunks for one streamed completion request."""

    def __init__(self, response_id: str, model: str, usage: StreamUsage, logprobs: bool, n: int = 1,
                 echo: Echo | None = None):
        """`n`: choices per prompt (several prompts: choice i is prompt i // n's)."""
        self.head = {"id": response_id, "object": "text_completion", "created": int(time.time()), "model": model}
        self.options = usage
        self.logprobs = logprobs
        self.usage = UsageTracker(n)
        self.offsets: dict[int, int] = {}
        self.echo = echo
        self.echoed: set[int] = set()  # choices whose first chunk carried the prompt's text

    def chunk(self, chunk: derender_pb2.ChatChunk) -> dict | None:
        own = self.usage.add(chunk)
        reason = finish_reason(chunk)
        if not chunk.content and reason is None and not chunk.logprobs:
            return None
        offset = self.offsets.get(chunk.index, 0)
        self.offsets[chunk.index] = offset + len(chunk.content)
        text = chunk.content
        if self.echo is not None and chunk.index not in self.echoed:
            self.echoed.add(chunk.index)
            text = self.echo.text(chunk.index) + text
        choice = {"index": chunk.index, "text": text,
                  "logprobs": completion_logprobs(chunk.logprobs, offset) if self.logprobs else None,
                  "finish_reason": reason}
        return stream_event(self.head, choice, self.options, own)

    def final(self) -> dict | None:
        if not self.options.include_usage:
            return None
        return {**self.head, "choices": [], "usage": usage_json(self.usage.usage)}
