"""Apply the chat template and tokenize, exactly as `tokenizer.apply_chat_template(tokenize=True)`
does (render the template to text, then encode it with add_special_tokens=False), mapping
template problems to caller errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jinja2

from tito.errors import FailedPrecondition, InvalidArgument

# Names apply_chat_template (or the template itself) already binds; a chat_template_kwargs key
# with one of these names would silently change how rendering works rather than feed the template.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


@dataclass(frozen=True)
class ChatRenderOptions:
    """How to apply the template (besides the messages and tools)."""

    chat_template: str | None = None
    template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise InvalidArgument(f"chat_template_kwargs.{key} is reserved: set it through its own request field",
                                  reason="RESERVED_TEMPLATE_KWARG", field=f"chat_template_kwargs.{key}")


def compile_check(template: str) -> None:
    """Reject a chat_template override that is not valid Jinja before using it."""
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidArgument(f"chat_template is not a valid Jinja template: {exc.message} (line {exc.lineno})",
                              reason="INVALID_CHAT_TEMPLATE", field="chat_template") from exc


def render_chat_text(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     options: ChatRenderOptions) -> str:
    """The prompt text the template renders."""
    if options.chat_template is not None:
        compile_check(options.chat_template)
    elif not getattr(tokenizer, "chat_template", None):
        raise FailedPrecondition("this model has no chat template: pass chat_template in the request",
                                 reason="NO_CHAT_TEMPLATE", field="chat_template")
    kwargs = dict(options.template_kwargs or {})
    check_template_kwargs(kwargs)
    template_field = "chat_template" if options.chat_template is not None else "messages"
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=options.chat_template, tokenize=False,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message, **kwargs)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidArgument(f"chat_template is not a valid Jinja template: {exc.message}",
                              reason="INVALID_CHAT_TEMPLATE", field="chat_template") from exc
    except jinja2.TemplateError as exc:
        # raise_exception(...) in the template, an undefined attribute, a sandbox refusal: the
        # template rejected this chat; its own message is the most useful thing to return.
        raise InvalidArgument(f"the chat template rejected the request: {exc.message or exc}",
                              reason="CHAT_TEMPLATE_ERROR", field=template_field) from exc
    except ValueError as exc:
        field = "continue_final_message" if options.continue_final_message else template_field
        raise InvalidArgument(f"could not apply the chat template: {str(exc).splitlines()[0]}",
                              reason="CHAT_TEMPLATE_ERROR", field=field) from exc
    except (TypeError, AttributeError, KeyError, IndexError, ArithmeticError, RecursionError) as exc:
        # Template code doing arithmetic, indexing or recursion on what this chat gave it
        # (1/0, 10.0 ** 400, a macro calling itself): the template's fault, not tito's.
        raise InvalidArgument(f"the chat template failed on this chat: {type(exc).__name__}: {exc}",
                              reason="CHAT_TEMPLATE_ERROR", field=template_field) from exc
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # e.g. a template that prints "\ud800"
        raise InvalidArgument(f"the chat template produced text that is not valid Unicode: {exc.reason}",
                              reason="CHAT_TEMPLATE_ERROR", field=template_field) from exc
    return text


def encode_prompt_text(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of `text` (a plain list, whatever the tokenizer class returns).

    For a plain `tokenizers`-backed tokenizer, `tokenizer(text)` is the Rust tokenizer's
    `encode_batch([text])` after resetting padding/truncation and setting `encode_special_tokens`
    (see TokenizersBackend._encode_plus), wrapped in a BatchEncoding: the backend's own `encode`
    gives the same ids without the wrapping (a few tens of microseconds per call), so it is used
    whenever that state already matches; anything else takes the Hugging Face call."""
    backend = _plain_backend(tokenizer)
    if (backend is not None and backend.truncation is None and backend.padding is None
            and backend.encode_special_tokens == tokenizer.split_special_tokens):
        return backend.encode(text, add_special_tokens=add_special_tokens).ids
    encoded = tokenizer(text, add_special_tokens=add_special_tokens)
    return [int(i) for i in encoded["input_ids"]]


_PLAIN_BACKEND_CLASSES: dict[type, bool] = {}


def _plain_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer behind `tokenizer` when its class encodes exactly as TokenizersBackend
    does (neither `__call__` nor `_encode_plus` overridden), else None."""
    cls = type(tokenizer)
    plain = _PLAIN_BACKEND_CLASSES.get(cls)
    if plain is None:
        try:
            from transformers.tokenization_utils_base import PreTrainedTokenizerBase
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:  # another transformers layout: always take the Hugging Face call
            plain = False
        else:
            plain = (issubclass(cls, TokenizersBackend) and cls._encode_plus is TokenizersBackend._encode_plus
                     and cls.__call__ is PreTrainedTokenizerBase.__call__)
        _PLAIN_BACKEND_CLASSES[cls] = plain
    return tokenizer._tokenizer if plain else None


def ends_inside_reasoning(text: str, start: str = "<think>", end: str = "</think>") -> bool:
    """Whether `text` ends inside an open reasoning block (a `<think>` with no `</think>` after)."""
    opened = text.rfind(start)
    return opened >= 0 and text.find(end, opened + len(start)) < 0
