"""Parser detection for the model families with their own markup, and which parsers need the
special tokens kept in the output text.

A family is recognised by its distinctive tokens in the vocabulary, or (when it shares its
vocabulary with another family) by its markup in the chat template; the rules are the
`detection` of each tito.parsers.TOOL_FORMATS entry, tried in its order:

| tool parser   | recognised by                                              |
| ------------- | ---------------------------------------------------------- |
| kimi_k2       | `<|tool_calls_section_begin|>` in the vocabulary           |
| deepseek_v3   | `<｜tool▁calls▁begin｜>` in the vocabulary                   |
| gpt_oss       | `<|channel|>` and `<|message|>` in the vocabulary          |
| glm45         | `<arg_key>` in the vocabulary                              |
| qwen3_coder   | `<tool_call>` in the vocabulary and `<function=` in the template |
| hermes        | `<tool_call>` in the vocabulary                            |

Reasoning: gpt_oss (harmony channels) for gpt-oss. DeepSeek's V3, R1 and V3.1 share one
vocabulary, so the template decides: a `thinking` switch (V3.1: the prompt itself opens or closes
the block, which "qwen3" follows through prompt_opens_reasoning) -> qwen3; `<think>` in the
template (R1's generation prompt opens the block) -> deepseek_r1; neither (V3) -> none. GLM-4.5
and others: render's original rules (model.detect_parsers: qwen3 with `<think>`/`</think>`).
"""

from __future__ import annotations

from typing import Any

from tito.parsers import REASONING_FORMATS, THINK, TOOL_FORMATS, detect_tool_format, markers_of

DEEPSEEK_SECTION = "<｜tool▁calls▁begin｜>"
HARMONY_CHANNEL, HARMONY_MESSAGE = "<|channel|>", "<|message|>"

#: The markers each parser reads (by the names DerenderContext carries, from tito.parsers): when
#: one of them is a special token of the tokenizer, the text must keep special tokens for the
#: parser to see it.
PARSER_MARKERS: dict[str, tuple[str, ...]] = {
    name: entry.markers for table in (REASONING_FORMATS, TOOL_FORMATS) for name, entry in table.items()
    if entry.markers}


def family_tool_parser(vocab: Any, template: str) -> str:
    """The tool parser tito.parsers detects for this vocabulary and template ("" for none): the
    family formats by their distinctive tokens (or template markup), then hermes."""
    return detect_tool_format(vocab, template)


def family_reasoning_parser(vocab: Any, template: str) -> str | None:
    """The family reasoning parser ("" for none), or None when the original rules decide."""
    if HARMONY_CHANNEL in vocab and HARMONY_MESSAGE in vocab:
        return "gpt_oss"
    if DEEPSEEK_SECTION in vocab:
        # One vocabulary (with <think>) for V3, R1 and V3.1: the template tells them apart.
        if not all(marker in vocab for marker in THINK):
            return ""
        if "thinking" in template:  # V3.1: the prompt opens or closes the block
            return "qwen3"
        return "deepseek_r1" if THINK[0] in template else ""  # R1's prompt opens <think>; V3 never thinks
    return None


def keeps_special_tokens(tokenizer: Any, *parsers: str) -> bool:
    """Whether a marker of one of `parsers` is a special token of `tokenizer` (decoding with
    skip_special_tokens would then drop it before derender's parser could see it)."""
    markers = markers_of(*parsers)
    if not markers:
        return False
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = {token.content for token in decoder.values() if getattr(token, "special", False)}
    return bool(markers & special)
