"""Chat templates of the model families whose markup derender parses with a family parser
(qwen3_coder, deepseek_v3 with deepseek_r1 / qwen3 reasoning, kimi_k2, glm45, gpt_oss), stored
unchanged as the models publish them (sources and licenses: README.md in this folder). The
offline family tokenizers (tests/support/family_tokenizers.py) carry them, and the tests check that render
gives the same text as the template rendered on its own."""

from __future__ import annotations

from importlib import resources

#: Family -> template file in this package.
TEMPLATE_FILES = {
    "qwen3_coder": "qwen3_coder.jinja",
    "deepseek_r1": "deepseek_r1.jinja",
    "deepseek_v31": "deepseek_v31.jinja",
    "kimi_k2": "kimi_k2.jinja",
    "glm45": "glm45.jinja",
    "gpt_oss": "gpt_oss.jinja",
}


def chat_template(family: str) -> str:
    """The stored chat template of `family` (a key of TEMPLATE_FILES)."""
    return resources.files(__name__).joinpath(TEMPLATE_FILES[family]).read_text(encoding="utf-8")
