"""The model as render sees it: tokenizer, chat template, context limit, generation defaults,
and the parser names derender should use. Loaded once at start-up (slow: run it off the loop)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tito.config import ConfigError
from tito_models.paths import resolve_model
from tito.vocab import Vocabulary, vocabulary_of

from tito_render.config import AUTO, NONE, RenderConfig
from tito_render.families import family_reasoning_parser, family_tool_parser, keeps_special_tokens
from tito_render.media.processors import load_media_adapter
from tito_render.template_compat import template_source
from tito_render.tool_markup import markup_variant

log = logging.getLogger(__name__)

#: tokenizer.model_max_length values at or above this are HF's "unknown" sentinel.
_UNKNOWN_MAX_LENGTH = 10**9
#: Generation-config keys render takes as sampling defaults (the ones vLLM's
#: `--generation-config auto` takes), with the range a value must be in to be used.
GENERATION_DEFAULT_KEYS = {
    "temperature": lambda v: v >= 0, "top_p": lambda v: 0 < v <= 1, "top_k": lambda v: v >= -1 and v == int(v),
    "min_p": lambda v: 0 <= v <= 1, "repetition_penalty": lambda v: v > 0,
    "presence_penalty": lambda v: -2 <= v <= 2, "frequency_penalty": lambda v: -2 <= v <= 2,
    "max_new_tokens": lambda v: v >= 1 and v == int(v),
}

THINK_START, THINK_END = "<think>", "</think>"


@dataclass
class RenderModel:
    """Everything render needs from the model directory."""

    model_id: str
    path: Path
    tokenizer: Any
    max_context_length: int
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    reasoning_parser: str = ""
    tool_parser: str = ""
    #: How this model writes tool calls (tool_markup.MARKUPS key; "" = the tool parser's name).
    tool_markup: str = ""
    #: Media adapter (image processor + placeholder rules); None for a text-only model.
    media: Any = None
    #: Characters of the longest vocabulary entry: no token covers more text than this.
    longest_token_chars: int = 1
    #: The parsers read markers that are special tokens of this tokenizer: skip_special_tokens
    #: defaults to false (a request may still set it).
    keep_special_tokens: bool = False
    #: Embedding rows vs tokenizer entries (tito.vocab); None: the tokenizer alone (no padding).
    vocabulary: Vocabulary | None = None

    @property
    def vocab_size(self) -> int:
        """Valid token ids are [0, vocab_size): the model's embedding rows (tito.vocab)."""
        return self.vocabulary.vocab_size if self.vocabulary is not None else len(self.tokenizer)

    @property
    def tokenizer_vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not readable JSON ({exc})") from exc
    return data if isinstance(data, dict) else {}


def model_context_length(model_config: dict[str, Any], tokenizer: Any) -> int | None:
    """The model's own context limit: config max_position_embeddings (top level or text_config),
    else the tokenizer's model_max_length when it is a real value."""
    for section in (model_config, model_config.get("text_config") or {}):
        value = section.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < _UNKNOWN_MAX_LENGTH:
        return value
    return None


def resolve_context_length(model_limit: int | None, override: int) -> int:
    if override:
        if model_limit is not None and override > model_limit:
            raise ConfigError(f"max_model_len={override} exceeds the model's context length {model_limit}; "
                              f"use a value <= {model_limit} (or 0 for the model's own)")
        return override
    if model_limit is None:
        raise ConfigError("the model declares no context length (no max_position_embeddings, no tokenizer "
                          "model_max_length): pass --max-model-len")
    return model_limit


def generation_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """Sampling defaults from generation_config.json: the numeric keys of GENERATION_DEFAULT_KEYS
    (an out-of-range value is ignored with a warning: every request would otherwise fail on a
    field it never set), plus `do_sample` when it is a boolean (sampling.py: `do_sample: false`
    makes an unset temperature 0, as Hugging Face decodes greedily then)."""
    defaults: dict[str, Any] = {}
    for key, in_range in GENERATION_DEFAULT_KEYS.items():
        value = generation_config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not in_range(value):
            log.warning("generation_config.json: ignoring %s=%r (out of range or not a number); "
                        "requests that leave %s unset get tito's default", key, value, key)
            continue
        defaults[key] = value
    if isinstance(generation_config.get("do_sample"), bool):
        defaults["do_sample"] = generation_config["do_sample"]
    return defaults


def detect_parsers(vocab: dict[str, int], reasoning: str, tool: str, template: str = "") -> tuple[str, str]:
    """Resolve "auto"/"none"/explicit parser settings to the names put in DerenderContext. The
    model families with their own markup come first (tito_render.families: by vocabulary, or by
    the chat `template` where families share a vocabulary)."""
    if reasoning == AUTO:
        reasoning = family_reasoning_parser(vocab, template)
        if reasoning is None:
            reasoning = "qwen3" if THINK_START in vocab and THINK_END in vocab else ""
    elif reasoning == NONE:
        reasoning = ""
    if tool == AUTO:
        tool = family_tool_parser(vocab, template)
    elif tool == NONE:
        tool = ""
    return reasoning, tool


def _parsers_of(tokenizer: Any, config: RenderConfig, template: str) -> tuple[str, str]:
    return detect_parsers(tokenizer.get_vocab(), config.reasoning_parser, config.tool_parser, template)


def model_parsers(config: RenderConfig) -> tuple[str, str]:
    """The reasoning and tool parser names render puts in its DerenderContexts for `config`'s
    model ("" for none), from its tokenizer alone: what a router that parses the engine's output
    itself (SMG in front of `tito serve all`) should parse with."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(config.model)))
    return _parsers_of(tokenizer, config, template_source(tokenizer, None))


def load_render_model(config: RenderConfig) -> RenderModel:
    """Resolve and load the tokenizer and settings (blocking, seconds)."""
    from transformers import AutoTokenizer

    path = resolve_model(config.model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model_config = _read_json(path / "config.json")
    limit = resolve_context_length(model_context_length(model_config, tokenizer), config.max_model_len)
    defaults = generation_defaults(_read_json(path / "generation_config.json"))
    template = template_source(tokenizer, None)
    reasoning, tool = _parsers_of(tokenizer, config, template)
    media = load_media_adapter(path, tokenizer)
    vocab = tokenizer.get_vocab()
    model = RenderModel(model_id=config.model, path=path, tokenizer=tokenizer, max_context_length=limit,
                        generation_defaults=defaults, reasoning_parser=reasoning, tool_parser=tool, media=media,
                        tool_markup=markup_variant(tool, vocab, template),
                        longest_token_chars=max(map(len, vocab), default=1),
                        keep_special_tokens=keeps_special_tokens(tokenizer, reasoning, tool),
                        vocabulary=vocabulary_of(tokenizer, model_config))
    log.info("loaded %s from %s: vocab %s, context %d, reasoning parser %r, tool parser %r, "
             "generation defaults %s", config.model, path, model.vocabulary.describe(), limit, reasoning, tool,
             defaults)
    return model
