"""Offline tokenizers of the model families with their own tool-call markup, for tests.

Each is the tiny models' byte-level BPE (:func:`tito_models.tiny.train_bpe`: ids 0..999) plus the
family's real added tokens, in the family's order and with its special / not-special flags, and
the family's real chat template (:mod:`tito_render.templates`). The ids of the added tokens are
not the real ones (they start at 1000; the real vocabularies are 100k+ tokens), but their text
and specialness are, which is what rendering and parsing depend on: a marker that is a special
token in the real tokenizer is one here too (decoded only with skip_special_tokens false), and
every marker encodes to its one token.

Families (:data:`FAMILIES`): ``qwen3_coder`` (Qwen3's tokens, XML tool calls), ``deepseek_r1``
and ``deepseek_v31`` (DeepSeek-V3's tokens; R1's and V3.1's templates), ``kimi_k2``, ``glm45``
and ``gpt_oss`` (harmony). Tokenizer directories only (no weights): render and derender load
them; the engine cannot.
:func:`ensure_family_tokenizer` builds one on first use and caches it like the tiny models.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tito_models.tiny import _write_text, build_cached, train_bpe

#: Bump whenever the produced bytes change, so cached copies are rebuilt.
VERSION = "v1"


@dataclass(frozen=True)
class Family:
    """One family's tokenizer: added tokens as (text, special), in id order from 1000."""

    template: str
    added: tuple[tuple[str, bool], ...]
    eos: str
    bos: str | None = None
    pad: str | None = None


def _all(special: bool, *tokens: str) -> tuple[tuple[str, bool], ...]:
    return tuple((token, special) for token in tokens)


# Qwen3 (and Qwen3-Coder): the first 14 are special, the rest are not (decode keeps them).
_QWEN3 = _all(True, "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
              "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
              "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>") + _all(
    False, "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>")
# DeepSeek-V3 / R1 / V3.1: sentence markers special; roles, <think> and the tool markers are added
# tokens that are not special (so the default skip_special_tokens keeps them).
_DEEPSEEK = _all(True, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>") + _all(
    False, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")
# Kimi-K2: every reserved token is special.
_KIMI = _all(True, "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
             "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|tool_calls_section_begin|>",
             "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
             "<|im_middle|>", "<|media_start|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")
# GLM-4.5: every added token is special, the tool-call and think markers included.
_GLM = _all(True, "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
            "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
            "<|end_of_video|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
            "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "/nothink")
# gpt-oss (o200k_harmony): the harmony markers are special.
_GPT_OSS = _all(True, "<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
                "<|start|>", "<|end|>", "<|message|>", "<|call|>")

FAMILIES: dict[str, Family] = {
    "qwen3_coder": Family("qwen3_coder", _QWEN3, eos="<|im_end|>", pad="<|endoftext|>"),
    "deepseek_r1": Family("deepseek_r1", _DEEPSEEK, eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>",
                          pad="<｜▁pad▁｜>"),
    "deepseek_v31": Family("deepseek_v31", _DEEPSEEK, eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>",
                           pad="<｜▁pad▁｜>"),
    "kimi_k2": Family("kimi_k2", _KIMI, eos="<|im_end|>", bos="[BOS]"),
    "glm45": Family("glm45", _GLM, eos="<|endoftext|>", pad="<|endoftext|>"),
    "gpt_oss": Family("gpt_oss", _GPT_OSS, eos="<|return|>", pad="<|endoftext|>"),
}


def build_family_tokenizer(name: str, out_dir: Path) -> Path:
    """Write the tokenizer of family `name` (tokenizer.json, tokenizer_config.json,
    chat_template.jinja) into `out_dir`."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from tito_render.templates import chat_template

    family = FAMILIES[name]
    backend = train_bpe()
    for text, special in family.added:
        token = AddedToken(text, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        (backend.add_special_tokens if special else backend.add_tokens)([token])
    expected = {text: 1000 + index for index, (text, _) in enumerate(family.added)}
    if {text: backend.token_to_id(text) for text in expected} != expected:
        raise RuntimeError(f"{name}: added tokens did not get ids 1000.. in order")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=family.eos, bos_token=family.bos,
                                        pad_token=family.pad, model_max_length=8192,
                                        clean_up_tokenization_spaces=False)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    _write_text(out_dir / "chat_template.jinja", chat_template(family.template))
    return out_dir


def _is_complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json",
                                                         "chat_template.jinja"))


def ensure_family_tokenizer(name: str, cache_dir: Path | None = None) -> Path:
    """The directory of family `name`'s tokenizer, built on first use (see build_cached)."""
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; expected one of {sorted(FAMILIES)}")
    return build_cached(f"family-{name}-{VERSION}", lambda out: build_family_tokenizer(name, out), _is_complete,
                        cache_dir)
