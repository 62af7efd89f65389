"""Tool calls written the way the XML-style families' models write them, as the parser tests'
model outputs: each parameter's value is text, and the parser types it by the tool's schema."""

from __future__ import annotations


def coder(name, **params):
    """A Qwen3-Coder call: `<function=name>` with one `<parameter=key>` block per parameter."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def glm(name, **params):
    """A GLM-4.5 call: the name, then an `<arg_key>` / `<arg_value>` pair per parameter."""
    body = "".join(f"\n<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>" for key, value in params.items())
    return f"<tool_call>{name}{body}\n</tool_call>"
