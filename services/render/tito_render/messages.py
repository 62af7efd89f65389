"""The chat (messages, tools, tool_choice: `domain` values) -> the plain dicts Hugging Face chat
templates expect, validating so that every caller mistake names its request field.

The dicts are exactly the OpenAI-style dicts a Python caller would pass to
`tokenizer.apply_chat_template`: string content stays a string, content parts stay a list of
`{"type": "text", "text": ...}` parts, unset optional fields are left out (as HF drops None keys).
Tool-call `arguments` given as a JSON string stay that string (after checking it parses as a JSON
object), so the ids equal HF's for the same OpenAI dicts; `arguments_object` becomes a dict. (A
template that cannot take the string gets it adapted right before rendering: template_compat.py.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

from tito.errors import InvalidArgument, Violations
from tito.json_text import MAX_STRUCT_DEPTH, loads_bounded

from tito_render.domain import (ChatMessage, ImagePart, ImageSource, JsonObject, TextPart, Tool, ToolCall,
                                ToolChoice, ToolChoiceMode, VideoPart)

ALLOWED_ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_CHOICE_MODES = frozenset(ToolChoiceMode)
_MAX_SAFE_INT = 2**53


class StructValueError(ValueError):
    """A Struct value render cannot take: a number JSON cannot hold (NaN, Infinity) or nesting past
    `MAX_STRUCT_DEPTH`. `reason` is the UPPER_SNAKE code; `where` locates the value (`x.min[1]`)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
        self._path: list[str | int] = []  # innermost first: filled in while the walk unwinds

    @property
    def where(self) -> str:
        parts = [f"[{part}]" if isinstance(part, int) else f".{part}" for part in reversed(self._path)]
        return "".join(parts).removeprefix(".")


def struct_to_dict(struct: JsonObject) -> dict[str, Any]:
    """A Struct's values (`domain.JsonObject`) -> the plain dict for the template.

    Two repairs of what the wire loses: a Struct stores every number as a double, so integral
    numbers become ints again (JSON the client meant as {"minimum": 1} must not render as 1.0);
    and a Struct is a map without key order, so keys are sorted, making the rendered prompt (and
    its prefix-cache keys) the same for the same request whatever order the map arrived in.

    The values are what `json_format.MessageToDict` gives for the Struct (same messages for
    Infinity/NaN, raised as `StructValueError`). Nesting past `MAX_STRUCT_DEPTH` is refused before
    it is walked, so a value nested thousands deep cannot exhaust the recursion limit here or in
    the template."""
    return _struct(struct, 1)


def request_struct(struct: JsonObject, field: str) -> dict[str, Any]:
    """`struct_to_dict` for a Struct the request carries at `field`: what it cannot hold is the
    caller's error, naming the field (and, in the message, where inside it)."""
    try:
        return struct_to_dict(struct)
    except StructValueError as exc:
        if exc.reason == "STRUCT_TOO_DEEP":
            raise InvalidArgument(f"{field} nests deeper than {MAX_STRUCT_DEPTH} levels (at {exc.where})",
                                  reason=exc.reason, field=field,
                                  metadata={"limit": "max_struct_depth", "max": str(MAX_STRUCT_DEPTH)}) from exc
        raise InvalidArgument(f"{field} holds NaN or Infinity at {exc.where}: JSON has no such numbers, send "
                              f"finite ones", reason=exc.reason, field=field) from exc


def _struct(struct: JsonObject, depth: int) -> dict[str, Any]:
    result = {}
    for key in sorted(struct):
        try:
            result[key] = _value(struct[key], depth)
        except StructValueError as exc:
            exc._path.append(key)
            raise
    return result


def _value(value: Any, depth: int) -> Any:
    """`value`, held by a container at nesting level `depth`."""
    if isinstance(value, (str, bool)):
        return value
    if isinstance(value, (int, float)):
        number = float(value)  # a Struct holds every number as a double
        if math.isinf(number):
            raise StructValueError("Fail to serialize Infinity for Value.number_value, which would parse as "
                                   "string_value", "NON_FINITE_NUMBER")
        if math.isnan(number):
            raise StructValueError("Fail to serialize NaN for Value.number_value, which would parse as string_value",
                                   "NON_FINITE_NUMBER")
        return int(number) if number.is_integer() and abs(number) < _MAX_SAFE_INT else number
    if isinstance(value, (dict, list)) and depth >= MAX_STRUCT_DEPTH:
        raise StructValueError(f"nested deeper than {MAX_STRUCT_DEPTH} levels", "STRUCT_TOO_DEEP")
    if isinstance(value, dict):
        return _struct(value, depth + 1)
    if isinstance(value, list):
        result = []
        for index, item in enumerate(value):
            try:
                result.append(_value(item, depth + 1))
            except StructValueError as exc:
                exc._path.append(index)
                raise
        return result
    return None  # null (a Value with no kind set reads as null too, as in MessageToDict)


def _content(message: ChatMessage, path: str, violations: Violations) -> Any:
    has_parts = len(message.content_parts) > 0
    if message.content is not None and has_parts:
        violations.add(f"{path}.content_parts", "set at most one of content and content_parts")
        return None
    if message.content is not None:
        return message.content
    if not has_parts:
        return None
    parts = []
    for j, part in enumerate(message.content_parts):
        if isinstance(part, TextPart):
            parts.append({"type": "text", "text": part.text})
        elif isinstance(part, ImagePart):
            # The template only needs to know an image is here; the media pipeline loads it
            # (collect_media) and expands the marker the template renders for it.
            parts.append({"type": "image"})
        elif isinstance(part, VideoPart):
            # Like images: the template marks the video, the media pipeline processes its frames.
            if not part.frames:
                violations.add(f"{path}.content_parts[{j}].video.frames", "a video needs at least one frame")
            parts.append({"type": "video"})
        else:
            violations.add(f"{path}.content_parts[{j}]", "empty content part: set text, image or video")
    return parts


@dataclass(frozen=True)
class ImageRef:
    """One image part of the chat, in prompt order, with its path in the request."""

    field: str
    source: ImageSource


@dataclass(frozen=True)
class VideoRef:
    """One video part (its frames, in order) with its path in the request."""

    field: str
    frames: tuple[ImageSource, ...]
    fps: float

    def frame_field(self, index: int) -> str:
        return f"{self.field}.frames[{index}]"


def _too_many_images(field: str, max_images: int) -> InvalidArgument:
    return InvalidArgument(f"too many images: at most max_images_per_request={max_images} "
                           f"(--max-images-per-request) per request, video frames included",
                           reason="TOO_MANY_IMAGES", field=field,
                           metadata={"limit": "max_images_per_request", "max": str(max_images)})


def collect_media(messages: Sequence[ChatMessage], max_images: int,
                  max_video_frames: int) -> list[ImageRef | VideoRef]:
    """The chat's image and video parts in order. Every image and every video frame counts toward
    `max_images`; a video holds at most `max_video_frames` frames. Over a limit is refused (naming
    the first image/frame over it) before anything is fetched or decoded."""
    refs: list[ImageRef | VideoRef] = []
    count = 0
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content_parts):
            if not isinstance(part, (ImagePart, VideoPart)):
                continue
            field = f"messages[{i}].content_parts[{j}].{part.KIND}"
            if isinstance(part, ImagePart):
                if count >= max_images:
                    raise _too_many_images(field, max_images)
                count += 1
                refs.append(ImageRef(field, part.source))
            else:
                ref = VideoRef(field, part.frames, float(part.fps))
                if len(ref.frames) > max_video_frames:
                    raise InvalidArgument(
                        f"video has {len(ref.frames)} frames, over the limit max_video_frames={max_video_frames} "
                        f"(--max-video-frames): sample fewer frames", reason="TOO_MANY_VIDEO_FRAMES",
                        field=ref.frame_field(max_video_frames),
                        metadata={"limit": "max_video_frames", "max": str(max_video_frames)})
                if count + len(ref.frames) > max_images:
                    raise _too_many_images(ref.frame_field(max_images - count), max_images)
                if not math.isfinite(ref.fps) or ref.fps < 0:
                    raise InvalidArgument(f"fps={ref.fps} must be a finite number >= 0 (0 = unknown)",
                                          reason="INVALID_VIDEO", field=f"{field}.fps")
                count += len(ref.frames)
                refs.append(ref)
    return refs


def _tool_call(call: ToolCall, path: str, violations: Violations) -> dict[str, Any]:
    if call.type not in ("", "function"):
        violations.add(f"{path}.type", f"tool call type {call.type!r} is not supported; use \"function\"")
    if not call.function.name:
        violations.add(f"{path}.function.name", "function name is empty")
    function: dict[str, Any] = {"name": call.function.name}
    if call.function.arguments is not None:
        try:
            parsed = loads_bounded(call.function.arguments, f"{path}.function.arguments")
        except ValueError as exc:
            parsed, problem = None, f"not valid JSON ({exc})"
        else:
            problem = None if isinstance(parsed, dict) else f"a JSON {type(parsed).__name__}, not an object"
        if problem:
            violations.add(f"{path}.function.arguments", f"arguments must be a JSON object: {problem}")
        function["arguments"] = call.function.arguments
    elif call.function.arguments_object is not None:
        function["arguments"] = request_struct(call.function.arguments_object, f"{path}.function.arguments_object")
    else:
        function["arguments"] = {}
    result: dict[str, Any] = {}
    if call.id:
        result["id"] = call.id
    result["type"] = "function"
    result["function"] = function
    return result


def messages_to_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Validate and convert the chat; raises InvalidArgument naming every bad field."""
    violations = Violations()
    if not messages:
        raise InvalidArgument("messages is empty: send at least one message", reason="EMPTY_MESSAGES",
                              field="messages")
    result = []
    for i, message in enumerate(messages):
        path = f"messages[{i}]"
        if message.role not in ALLOWED_ROLES:
            violations.add(f"{path}.role", f"unknown role {message.role!r}; use one of {', '.join(ALLOWED_ROLES)}")
        entry: dict[str, Any] = {"role": message.role}
        content = _content(message, path, violations)
        if content is not None:
            entry["content"] = content
        if message.name:
            entry["name"] = message.name
        if message.tool_calls:
            if message.role != "assistant":
                violations.add(f"{path}.tool_calls", "only assistant messages carry tool_calls")
            entry["tool_calls"] = [_tool_call(call, f"{path}.tool_calls[{j}]", violations)
                                   for j, call in enumerate(message.tool_calls)]
        # A tool message without tool_call_id is allowed: Qwen-style templates never read it.
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        result.append(entry)
    violations.raise_if_any()
    return result


def tools_to_dicts(tools: Sequence[Tool]) -> list[dict[str, Any]] | None:
    """Tools -> OpenAI tool dicts (None when there are none, as HF expects)."""
    if not tools:
        return None
    violations = Violations()
    result = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.type not in ("", "function"):
            violations.add(f"tools[{i}].type", f"tool type {tool.type!r} is not supported; use \"function\"")
        name = tool.function.name
        if not name:
            violations.add(f"tools[{i}].function.name", "function name is empty")
        elif name in seen:
            violations.add(f"tools[{i}].function.name", f"duplicate function name {name!r}")
        seen.add(name)
        function: dict[str, Any] = {"name": name}
        if tool.function.description:
            function["description"] = tool.function.description
        if tool.function.parameters is not None:
            function["parameters"] = request_struct(tool.function.parameters, f"tools[{i}].function.parameters")
        if tool.function.strict is not None:
            function["strict"] = tool.function.strict
        result.append({"type": "function", "function": function})
    violations.raise_if_any()
    return result


def resolve_tool_choice(choice: ToolChoice, tools: Sequence[Tool]) -> ToolChoice:
    """Validate tool_choice against the tools and make UNSPECIFIED explicit (AUTO with tools, NONE
    without). NONE keeps the tools in the prompt (as vLLM does by default): the model still sees
    them, derender then leaves any tool-call markup as plain content."""
    names = {tool.function.name for tool in tools}
    if choice.function_name is not None:
        if choice.function_name not in names:
            raise InvalidArgument(
                f"tool_choice names function {choice.function_name!r}, which is not among the tools"
                + (f" ({', '.join(sorted(names))})" if names else " (no tools were given)"),
                reason="UNKNOWN_TOOL", field="tool_choice.function_name")
        return ToolChoice(function_name=choice.function_name)
    mode = choice.mode
    if mode not in _TOOL_CHOICE_MODES:
        raise InvalidArgument(f"unknown tool_choice mode {mode}", reason="INVALID_TOOL_CHOICE",
                              field="tool_choice.mode")
    if mode == ToolChoiceMode.UNSPECIFIED:
        mode = ToolChoiceMode.AUTO if tools else ToolChoiceMode.NONE
    if mode == ToolChoiceMode.REQUIRED and not tools:
        raise InvalidArgument("tool_choice REQUIRED needs at least one tool", reason="INVALID_TOOL_CHOICE",
                              field="tool_choice.mode")
    return ToolChoice(mode=ToolChoiceMode(mode))
