"""tito.parsers declares each output format once: render and derender offer exactly its names,
and every tool format has its derender parser where the registry says it is."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tito.parsers import (REASONING_FORMATS, REASONING_PARSER_NAMES, TOOL_FORMATS, TOOL_PARSER_NAMES,
                          detect_tool_format, markers_of)


def test_render_and_derender_offer_exactly_the_registered_names():
    from tito_derender.parsers import REASONING_PARSERS, TOOL_PARSERS
    from tito_render.config import REASONING_PARSERS as RENDER_REASONING
    from tito_render.config import TOOL_PARSERS as RENDER_TOOLS

    assert tuple(TOOL_PARSERS) == TOOL_PARSER_NAMES == RENDER_TOOLS
    assert tuple(REASONING_PARSERS) == REASONING_PARSER_NAMES == RENDER_REASONING


@pytest.mark.parametrize("name", TOOL_PARSER_NAMES)
def test_each_tool_format_has_its_parser_module(name):
    import importlib

    from tito_derender.parsers import TOOL_PARSERS
    from tito_derender.parsers.tools.base import ToolParser

    module = importlib.import_module(f"tito_derender.parsers.tools.{name}")
    assert module.PARSER is TOOL_PARSERS[name] and issubclass(module.PARSER, ToolParser)


def test_a_detection_that_another_contains_is_tried_after_it():
    """hermes (`<tool_call>`) after qwen3_coder (`<tool_call>` and `<function=` in the template)."""
    entries = [entry for entry in TOOL_FORMATS.values() if entry.detection]
    for i, earlier in enumerate(entries):
        for later in entries[i + 1:]:
            a, b = earlier.detection, later.detection
            contained = set(a.vocabulary) <= set(b.vocabulary) and set(a.template) <= set(b.template)
            assert not contained, f"{later.name} can never be detected: {earlier.name} matches first"


@pytest.mark.parametrize("vocab,template,expected", [
    ({"<tool_call>"}, "", "hermes"),
    ({"<tool_call>"}, "{{ '<function=' }}", "qwen3_coder"),
    ({"<tool_call>", "<arg_key>"}, "<function=", "glm45"),
    ({"<|tool_calls_section_begin|>", "<tool_call>"}, "", "kimi_k2"),
    ({"hello"}, "", ""),
])
def test_detection_follows_the_registry(vocab, template, expected):
    assert detect_tool_format(vocab, template) == expected


def test_markers_cover_tool_and_reasoning_names():
    assert "<think>" in markers_of("qwen3") and "<arg_key>" in markers_of("glm45")
    assert markers_of("no-such-parser") == frozenset()
    assert set(REASONING_FORMATS) == {"qwen3", "deepseek_r1", "gpt_oss"}


def test_the_registry_imports_alone():
    """Plain data: importable without torch, transformers or any service."""
    code = ("import sys, tito.parsers; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'grpc') "
            "or m.startswith('tito_')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
