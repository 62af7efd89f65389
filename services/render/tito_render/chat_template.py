"""Apply the chat template and tokenize, exactly as `tokenizer.apply_chat_template(tokenize=True)`
does (render the template to text, then encode it with add_special_tokens=False), mapping
template problems to caller errors.

Templates run in `BoundedSandbox`: transformers' sandbox with bounds on what a template can build
(a request may bring its own template, and the model's own gets the request's data)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment

from tito.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from tito_render.deadline import WATCHDOG, TemplateTimeout
from tito_render.template_compat import adapt_messages, template_source

# Names apply_chat_template (or the template itself) already binds; a chat_template_kwargs key
# with one of these names would silently change how rendering works rather than feed the template.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


#: Bounds on what a chat template may build, each checked before the allocation it guards. A chat's
#: prompt is a few million characters at most (it must fit the context); these are far above what
#: any real template builds and far below what would exhaust a server.
MAX_TEMPLATE_OUTPUT_CHARS = 64 * 1024 * 1024  # the rendered text, and each macro / {% set %} block
MAX_TEMPLATE_REPEAT = 1024 * 1024  # items in one `sequence * n` ('=' * 80 is fine)
MAX_TEMPLATE_INT_BITS = 65536  # bits in one `a * b` or `a ** b` of integers (2 ** 64 is fine)
MAX_TEMPLATE_RANGE = MAX_RANGE  # items in one range(), as jinja's sandbox already bounds it
DEFAULT_TEMPLATE_SECONDS = 10.0  # a chat template's run time (--max-template-seconds)


class TemplateTooLarge(jinja2.exceptions.SecurityError):
    """A template tried to build something past one of the bounds above."""

    def __init__(self, what: str, limit: str, maximum: int) -> None:
        super().__init__(f"{what}, over the limit {limit}={maximum}")
        self.limit = limit
        self.maximum = maximum


def _check_product(left: Any, right: Any) -> None:
    if isinstance(left, int) and isinstance(right, int):
        if left.bit_length() + right.bit_length() > MAX_TEMPLATE_INT_BITS:
            raise TemplateTooLarge("an integer product of more bits", "max_template_int_bits", MAX_TEMPLATE_INT_BITS)
        return
    for sequence, count in ((left, right), (right, left)):
        if isinstance(sequence, (str, list, tuple)) and isinstance(count, int) \
                and len(sequence) * count > MAX_TEMPLATE_REPEAT:
            raise TemplateTooLarge(f"repeating a {type(sequence).__name__} to {len(sequence) * count} items",
                                   "max_template_repeat", MAX_TEMPLATE_REPEAT)


def _check_power(base: Any, exponent: Any) -> None:
    # (bit_length - 1) * exponent: a lower bound on the result's bits, cheap to compute first.
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 \
            and (abs(base).bit_length() - 1) * exponent > MAX_TEMPLATE_INT_BITS:
        raise TemplateTooLarge("an integer power of more bits", "max_template_int_bits", MAX_TEMPLATE_INT_BITS)


def _bounded_range(*args: int) -> range:
    """jinja's sandboxed range (same bound), refused as TEMPLATE_TOO_LARGE rather than OverflowError."""
    result = range(*args)
    try:
        too_long = len(result) > MAX_TEMPLATE_RANGE
    except OverflowError:  # longer than sys.maxsize
        too_long = True
    if too_long:
        raise TemplateTooLarge("a range() of more items", "max_template_range", MAX_TEMPLATE_RANGE)
    return result


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template sandbox (ImmutableSandboxedEnvironment) plus bounds, so that a
    template like `{{ 'x' * 10**10 }}` is refused before it allocates instead of taking the
    server's memory: `*` and `**` go through `call_binop` (jinja's documented operator
    interception; intercepted operators are not constant-folded at compile time either), `range`
    is bounded, and `concat`, which joins the output of the template and of each macro and block,
    stops at MAX_TEMPLATE_OUTPUT_CHARS. Other ways to build large strings (`~` in loops, `%`
    formatting, str methods) are not bounded here; one that cannot be satisfied fails with
    MemoryError, which `render_chat_text` maps to the same error."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.globals["range"] = _bounded_range

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            _check_product(left, right)
        elif operator == "**":
            _check_power(left, right)
        return super().call_binop(context, operator, left, right)

    def concat(self, parts: Iterable[str]) -> str:  # jinja's is "".join
        # Counting as it goes: the template's output is a generator, so a runaway loop stops at the
        # bound instead of after filling memory (empty pieces are not kept: they cost memory too).
        pieces: list[str] = []
        size = 0
        for part in parts:
            if part:
                size += len(part)
                if size > MAX_TEMPLATE_OUTPUT_CHARS:
                    raise TemplateTooLarge("output of more characters", "max_template_output_chars",
                                           MAX_TEMPLATE_OUTPUT_CHARS)
                pieces.append(part)
        return "".join(pieces)


_SANDBOX_INSTALLED = False


def _use_bounded_sandbox() -> None:
    """Make transformers compile chat templates in `BoundedSandbox`.

    transformers (5.19, pinned) creates its sandbox in chat_template_utils from the module-level
    name `ImmutableSandboxedEnvironment` and offers no way to pass another, so render rebinds that
    name (render is the only user of chat templates in its process). tests/integration/
    test_render_hostile.py fails if a transformers upgrade stops honouring it."""
    global _SANDBOX_INSTALLED
    if _SANDBOX_INSTALLED:
        return
    from transformers.utils import chat_template_utils

    chat_template_utils.ImmutableSandboxedEnvironment = BoundedSandbox
    chat_template_utils._compile_jinja_template.cache_clear()  # nothing compiled before keeps the old one
    _SANDBOX_INSTALLED = True


@dataclass(frozen=True)
class ChatRenderOptions:
    """How to apply the template (besides the messages and tools)."""

    chat_template: str | None = None
    template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    time_limit: float = DEFAULT_TEMPLATE_SECONDS  # seconds the template may run (deadline.py)


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
    messages = adapt_messages(messages, template_source(tokenizer, options.chat_template))
    _use_bounded_sandbox()
    try:
        with WATCHDOG.limit(options.time_limit):
            text = tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=options.chat_template, tokenize=False,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, **kwargs)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidArgument(f"chat_template is not a valid Jinja template: {exc.message}",
                              reason="INVALID_CHAT_TEMPLATE", field="chat_template") from exc
    except TemplateTimeout:
        raise ResourceExhausted(f"the chat template ran past its time limit of {options.time_limit:g} s on this "
                                f"chat (or its caller went away)", reason="TEMPLATE_TIMEOUT", field=template_field,
                                metadata={"limit": "max_template_seconds",
                                          "max": f"{options.time_limit:g}"}) from None
    except TemplateTooLarge as exc:
        raise ResourceExhausted(f"the chat template built too much on this chat: {exc.message}",
                                reason="TEMPLATE_TOO_LARGE", field=template_field,
                                metadata={"limit": exc.limit, "max": str(exc.maximum)}) from exc
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
    except MemoryError as exc:
        # An allocation BoundedSandbox does not bound ('%999999999999s' % x, 'x'.ljust(n)) that the
        # system refused outright: nothing was taken, the server carries on.
        raise ResourceExhausted("the chat template ran out of memory on this chat",
                                reason="TEMPLATE_TOO_LARGE", field=template_field) from exc
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
