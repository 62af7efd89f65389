"""Proto chat (messages, tools, tool_choice) -> the plain dicts Hugging Face chat templates expect,
validating at the edge so that every caller mistake names its field.

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
from typing import Any

from google.protobuf import struct_pb2

from tito.errors import InvalidArgument, Violations
from tito.json_text import MAX_STRUCT_DEPTH, loads_bounded
from tito.v1 import chat_pb2

ALLOWED_ROLES = ("system", "developer", "user", "assistant", "tool")
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


def struct_to_dict(struct: struct_pb2.Struct) -> dict[str, Any]:
    """Struct -> plain dict for the template.

    Two repairs of what the wire loses: a Struct stores every number as a double, so integral
    numbers become ints again (JSON the client meant as {"minimum": 1} must not render as 1.0);
    and a Struct is a map without key order, so keys are sorted, making the rendered prompt (and
    its prefix-cache keys) the same for the same request whatever order the map arrived in.

    The values are what `json_format.MessageToDict` gives (same messages for Infinity/NaN, raised
    as `StructValueError`), walked directly: MessageToDict's generic printer costs several times
    more per tool schema. Nesting past `MAX_STRUCT_DEPTH` is refused before it is walked, so a
    value nested thousands deep cannot exhaust the recursion limit here or in the template."""
    return _struct(struct, 1)


def request_struct(struct: struct_pb2.Struct, field: str) -> dict[str, Any]:
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


def _struct(struct: struct_pb2.Struct, depth: int) -> dict[str, Any]:
    fields = struct.fields
    result = {}
    for key in sorted(fields):
        try:
            result[key] = _value(fields[key], depth)
        except StructValueError as exc:
            exc._path.append(key)
            raise
    return result


def _value(value: struct_pb2.Value, depth: int) -> Any:
    """`value`, held by a container at nesting level `depth`."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "number_value":
        number = value.number_value
        if math.isinf(number):
            raise StructValueError("Fail to serialize Infinity for Value.number_value, which would parse as "
                                   "string_value", "NON_FINITE_NUMBER")
        if math.isnan(number):
            raise StructValueError("Fail to serialize NaN for Value.number_value, which would parse as string_value",
                                   "NON_FINITE_NUMBER")
        return int(number) if number.is_integer() and abs(number) < _MAX_SAFE_INT else number
    if kind == "bool_value":
        return value.bool_value
    if kind in ("struct_value", "list_value") and depth >= MAX_STRUCT_DEPTH:
        raise StructValueError(f"nested deeper than {MAX_STRUCT_DEPTH} levels", "STRUCT_TOO_DEEP")
    if kind == "struct_value":
        return _struct(value.struct_value, depth + 1)
    if kind == "list_value":
        result = []
        for index, item in enumerate(value.list_value.values):
            try:
                result.append(_value(item, depth + 1))
            except StructValueError as exc:
                exc._path.append(index)
                raise
        return result
    return None  # null_value, or no kind set (MessageToDict reads both as null)


def _content(message: chat_pb2.ChatMessage, path: str, violations: Violations) -> Any:
    has_parts = len(message.content_parts) > 0
    if message.HasField("content") and has_parts:
        violations.add(f"{path}.content_parts", "set at most one of content and content_parts")
        return None
    if message.HasField("content"):
        return message.content
    if not has_parts:
        return None
    parts = []
    for j, part in enumerate(message.content_parts):
        kind = part.WhichOneof("part")
        if kind == "text":
            parts.append({"type": "text", "text": part.text})
        elif kind == "image":
            # The template only needs to know an image is here; the media pipeline loads it
            # (collect_media) and expands the marker the template renders for it.
            parts.append({"type": "image"})
        elif kind == "video":
            # Like images: the template marks the video, the media pipeline processes its frames.
            if not part.video.frames:
                violations.add(f"{path}.content_parts[{j}].video.frames", "a video needs at least one frame")
            parts.append({"type": "video"})
        else:
            violations.add(f"{path}.content_parts[{j}]", "empty content part: set text, image or video")
    return parts


@dataclass(frozen=True)
class ImageRef:
    """One image part of the chat, in prompt order, with its path in the request."""

    field: str
    source: chat_pb2.ImageSource


@dataclass(frozen=True)
class VideoRef:
    """One video part (its frames, in order) with its path in the request."""

    field: str
    frames: tuple[chat_pb2.ImageSource, ...]
    fps: float

    def frame_field(self, index: int) -> str:
        return f"{self.field}.frames[{index}]"


def _too_many_images(field: str, max_images: int) -> InvalidArgument:
    return InvalidArgument(f"too many images: at most max_images_per_request={max_images} "
                           f"(--max-images-per-request) per request, video frames included",
                           reason="TOO_MANY_IMAGES", field=field,
                           metadata={"limit": "max_images_per_request", "max": str(max_images)})


def collect_media(messages: list[chat_pb2.ChatMessage], max_images: int,
                  max_video_frames: int) -> list[ImageRef | VideoRef]:
    """The chat's image and video parts in order. Every image and every video frame counts toward
    `max_images`; a video holds at most `max_video_frames` frames. Over a limit is refused (naming
    the first image/frame over it) before anything is fetched or decoded."""
    refs: list[ImageRef | VideoRef] = []
    count = 0
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content_parts):
            kind = part.WhichOneof("part")
            field = f"messages[{i}].content_parts[{j}].{kind}"
            if kind == "image":
                if count >= max_images:
                    raise _too_many_images(field, max_images)
                count += 1
                refs.append(ImageRef(field, part.image))
            elif kind == "video":
                ref = VideoRef(field, tuple(part.video.frames), float(part.video.fps))
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


def _tool_call(call: chat_pb2.ToolCall, path: str, violations: Violations) -> dict[str, Any]:
    if call.type not in ("", "function"):
        violations.add(f"{path}.type", f"tool call type {call.type!r} is not supported; use \"function\"")
    if not call.function.name:
        violations.add(f"{path}.function.name", "function name is empty")
    function: dict[str, Any] = {"name": call.function.name}
    kind = call.function.WhichOneof("args")
    if kind == "arguments":
        try:
            parsed = loads_bounded(call.function.arguments, f"{path}.function.arguments")
        except ValueError as exc:
            parsed, problem = None, f"not valid JSON ({exc})"
        else:
            problem = None if isinstance(parsed, dict) else f"a JSON {type(parsed).__name__}, not an object"
        if problem:
            violations.add(f"{path}.function.arguments", f"arguments must be a JSON object: {problem}")
        function["arguments"] = call.function.arguments
    elif kind == "arguments_object":
        function["arguments"] = request_struct(call.function.arguments_object, f"{path}.function.arguments_object")
    else:
        function["arguments"] = {}
    result: dict[str, Any] = {}
    if call.id:
        result["id"] = call.id
    result["type"] = "function"
    result["function"] = function
    return result


def messages_to_dicts(messages: list[chat_pb2.ChatMessage]) -> list[dict[str, Any]]:
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
        if message.HasField("reasoning_content"):
            entry["reasoning_content"] = message.reasoning_content
        result.append(entry)
    violations.raise_if_any()
    return result


def tools_to_dicts(tools: list[chat_pb2.Tool]) -> list[dict[str, Any]] | None:
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
        if tool.function.HasField("parameters"):
            function["parameters"] = request_struct(tool.function.parameters, f"tools[{i}].function.parameters")
        if tool.function.HasField("strict"):
            function["strict"] = tool.function.strict
        result.append({"type": "function", "function": function})
    violations.raise_if_any()
    return result


def resolve_tool_choice(choice: chat_pb2.ToolChoice, tools: list[chat_pb2.Tool]) -> chat_pb2.ToolChoice:
    """Validate tool_choice against the tools and make UNSPECIFIED explicit (AUTO with tools, NONE
    without). NONE keeps the tools in the prompt (as vLLM does by default): the model still sees
    them, derender then leaves any tool-call markup as plain content."""
    names = {tool.function.name for tool in tools}
    kind = choice.WhichOneof("choice")
    if kind == "function_name":
        if choice.function_name not in names:
            raise InvalidArgument(
                f"tool_choice names function {choice.function_name!r}, which is not among the tools"
                + (f" ({', '.join(sorted(names))})" if names else " (no tools were given)"),
                reason="UNKNOWN_TOOL", field="tool_choice.function_name")
        return chat_pb2.ToolChoice(function_name=choice.function_name)
    mode = choice.mode if kind == "mode" else chat_pb2.TOOL_CHOICE_MODE_UNSPECIFIED
    if mode not in chat_pb2.ToolChoiceMode.values():
        raise InvalidArgument(f"unknown tool_choice mode {mode}", reason="INVALID_TOOL_CHOICE",
                              field="tool_choice.mode")
    if mode == chat_pb2.TOOL_CHOICE_MODE_UNSPECIFIED:
        mode = chat_pb2.TOOL_CHOICE_MODE_AUTO if tools else chat_pb2.TOOL_CHOICE_MODE_NONE
    if mode == chat_pb2.TOOL_CHOICE_MODE_REQUIRED and not tools:
        raise InvalidArgument("tool_choice REQUIRED needs at least one tool", reason="INVALID_TOOL_CHOICE",
                              field="tool_choice.mode")
    return chat_pb2.ToolChoice(mode=mode)
