"""`tito chat`'s printer: reasoning as a "thinking:" section, content, tool calls on their own lines."""

from __future__ import annotations

import io

from tito_client.chat_output import DIM, RESET, ChatPrinter
from tito.v1 import derender_pb2, engine_pb2


def _print(chunks, color: bool = False) -> str:
    out = io.StringIO()
    printer = ChatPrinter(out, color=color)
    for chunk in chunks:
        printer.chunk(chunk)
    return out.getvalue()


def _finish(reason=engine_pb2.FINISH_REASON_STOP) -> derender_pb2.ChatChunk:
    return derender_pb2.ChatChunk(finish_reason=reason, usage={"prompt_tokens": 9, "completion_tokens": 4})


def test_reasoning_then_content_split_into_sections_without_markup_newlines():
    chunks = [derender_pb2.ChatChunk(reasoning_content="\nThe image"),
              derender_pb2.ChatChunk(reasoning_content=" is red.\n"),
              derender_pb2.ChatChunk(content="\n\nIt is"), derender_pb2.ChatChunk(content=" red.\n\nBye."),
              _finish()]
    assert _print(chunks) == ("thinking: The image is red.\nIt is red.\n\nBye.\n"
                              "[finish_reason=FINISH_REASON_STOP prompt_tokens=9 completion_tokens=4]\n")


def test_reasoning_is_dimmed_on_a_terminal():
    output = _print([derender_pb2.ChatChunk(reasoning_content="hm"), derender_pb2.ChatChunk(content="ok"),
                     _finish()], color=True)
    assert output.startswith(f"{DIM}thinking: hm{RESET}\nok\n[finish_reason=")


def test_each_tool_call_gets_a_line_with_its_streamed_arguments():
    chunks = [derender_pb2.ChatChunk(reasoning_content="call it"), derender_pb2.ChatChunk(content="\n\n"),
              derender_pb2.ChatChunk(tool_calls=[{"index": 0, "id": "call_a", "type": "function",
                                                  "name": "get_weather"}]),
              derender_pb2.ChatChunk(tool_calls=[{"index": 0, "arguments": '{"city": '}]),
              derender_pb2.ChatChunk(tool_calls=[{"index": 0, "arguments": '"Paris"}'}]),
              derender_pb2.ChatChunk(tool_calls=[{"index": 1, "id": "call_b", "type": "function", "name": "f",
                                                  "arguments": "{}"}]),
              _finish(engine_pb2.FINISH_REASON_TOOL_CALLS)]
    assert _print(chunks).splitlines() == [
        "thinking: call it", 'tool call: get_weather({"city": "Paris"})', "tool call: f({})",
        "[finish_reason=FINISH_REASON_TOOL_CALLS prompt_tokens=9 completion_tokens=4]"]


def test_plain_content_prints_as_before():
    assert _print([derender_pb2.ChatChunk(content="Hello there"), _finish()]) == (
        "Hello there\n[finish_reason=FINISH_REASON_STOP prompt_tokens=9 completion_tokens=4]\n")


def test_tito_chat_refuses_a_tools_file_that_is_not_a_list_of_tools(tmp_path, capsys):
    from tito_cli.main import main

    bad = tmp_path / "tools.json"
    bad.write_text('{"type": "function"}')
    assert main(["chat", "hi", "--tools", str(bad)]) == 2
    assert "expected a JSON list of tools" in capsys.readouterr().err
    assert main(["chat", "hi", "--tools", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
