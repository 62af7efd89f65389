"""Long text is tokenized in a helper process, with exactly the in-process ids."""

from __future__ import annotations

import multiprocessing

from transformers import AutoTokenizer

from tito_render.chat_template import encode_prompt_text
from tito_render.long_text import IN_PROCESS_CHARS, LongTextEncoder


def test_long_text_gives_the_same_ids_as_in_process(tiny_text_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_text_model)
    encoder = LongTextEncoder(tokenizer, tiny_text_model)
    try:
        short = "Hello there, café 🎉"
        long = ("The sea, the sky and <|im_end|> the river 日本 " * 4000)[: IN_PROCESS_CHARS * 2]
        assert encoder.encode(short, False) == encode_prompt_text(tokenizer, short, False)
        for add_special in (False, True):
            assert encoder.encode(long, add_special) == encode_prompt_text(tokenizer, long, add_special)
    finally:
        encoder.close()


def test_close_waits_for_the_helper_to_exit(tiny_text_model):
    """At exit multiprocessing joins every child: a helper still alive after close() can hang it."""
    encoder = LongTextEncoder(AutoTokenizer.from_pretrained(tiny_text_model), tiny_text_model)
    encoder.encode("x" * (IN_PROCESS_CHARS + 1), False)  # starts the helper
    assert len(multiprocessing.active_children()) == 1
    encoder.close()
    assert multiprocessing.active_children() == []
    encoder.close()  # closing twice is harmless
