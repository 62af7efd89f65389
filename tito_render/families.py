"""Parser detection for the model families with their own markup, and which parsers need the
special tokens kept in the output text.

A family is recognised by its distinctive tokens in the vocabulary, or (when it shares its
vocabulary with another family) by its markup in the chat template:

| tool parser   | recognised by                                              |
| ------------- | ---------------------------------------------------------- |
| kimi_k2       | `<|tool_calls_section_begin|>` in the vocabulary           |
| deepseek_v3   | `<｜tool▁calls▁begin｜>` in the vocabulary                   |
| gpt_oss       | `<|channel|>` and `<|message|>` in the vocabulary          |
| glm45         | `<arg_key>` in the vocabulary                              |
| qwen3_coder   | `<tool_call>` in the vocabulary and `<function=` in the template |

Reasoning: gpt_oss (harmony channels) for gpt-oss; for DeepSeek, deepseek_r1 (output starts as
reasoning) unless the template has a `thinking` switch (V3.1: the prompt itself opens or closes
the block, which "qwen3" follows through prompt_opens_reasoning); for GLM-4.5 qwen3 (the output
opens its `<think>` block). Other models: render's original rules (model.detect_parsers).
"""

from __future__ import annotations

from typing import Any

KIMI_SECTION = "<|tool_calls_section_begin|>"
DEEPSEEK_SECTION = "<｜tool▁calls▁begin｜>"
HARMONY_CHANNEL, HARMONY_MESSAGE = "<|channel|>", "<|message|>"
GLM_ARG_KEY = "<arg_key>"
TOOL_CALL = "<tool_call>"
CODER_FUNCTION = "<function="
THINK = ("<think>", "</think>")

#: The markers each parser reads (by the names DerenderContext carries): when one of them is a
#: special token of the tokenizer, the text must keep special tokens for the parser to see it.
PARSER_MARKERS: dict[str, tuple[str, ...]] = {
    "qwen3": THINK,
    "deepseek_r1": THINK,
    "gpt_oss": ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|constrain|>"),
    "qwen3_coder": ("<tool_call>", "</tool_call>"),
    "deepseek_v3": (DEEPSEEK_SECTION, "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>"),
    "kimi_k2": (KIMI_SECTION, "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                "<|tool_call_end|>"),
    "glm45": ("<tool_call>", "</tool_call>", GLM_ARG_KEY, "</arg_key>", "<arg_value>", "</arg_value>"),
}


def family_tool_parser(vocab: Any, template: str) -> str:
    """The family tool parser for this vocabulary and template, "" when it is no such family."""
    if KIMI_SECTION in vocab:
        return "kimi_k2"
    if DEEPSEEK_SECTION in vocab:
        return "deepseek_v3"
    if HARMONY_CHANNEL in vocab and HARMONY_MESSAGE in vocab:
        return "gpt_oss"
    if GLM_ARG_KEY in vocab:
        return "glm45"
    if TOOL_CALL in vocab and CODER_FUNCTION in template:
        return "qwen3_coder"
    return ""


def family_reasoning_parser(vocab: Any, template: str) -> str | None:
    """The family reasoning parser ("" for none), or None when the original rules decide."""
    if HARMONY_CHANNEL in vocab and HARMONY_MESSAGE in vocab:
        return "gpt_oss"
    has_think = all(marker in vocab for marker in THINK)
    if DEEPSEEK_SECTION in vocab:
        if not has_think:
            return ""
        return "qwen3" if "thinking" in template else "deepseek_r1"
    return None


def keeps_special_tokens(tokenizer: Any, *parsers: str) -> bool:
    """Whether a marker of one of `parsers` is a special token of `tokenizer` (decoding with
    skip_special_tokens would then drop it before derender's parser could see it)."""
    markers = {marker for parser in parsers for marker in PARSER_MARKERS.get(parser, ())}
    if not markers:
        return False
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = {token.content for token in decoder.values() if getattr(token, "special", False)}
    return bool(markers & special)
