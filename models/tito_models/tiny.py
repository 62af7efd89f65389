"""Deterministic, offline builder for tiny Hugging Face model directories.

The models built here are random-weight toys (Qwen2, Qwen2-VL, Gemma3, Llama, Qwen3, Qwen2.5-VL,
Qwen3-VL) used by the tests and as the default model of ``tito serve``.  Nothing is downloaded:
the tokenizer is trained from a corpus embedded in this module and the weights come from
private generators seeded per parameter name (normal(0, 0.2) for matrices, so
greedy output is varied), so every build writes byte-identical files.  Only
``tokenizers``, ``torch`` and ``transformers`` are needed, imported lazily.

Thirteen models are available:

``tiny-qwen2`` (:data:`TEXT_MODEL`, :func:`build_text_model`)
    ``Qwen2ForCausalLM``: hidden size 64, 2 layers, 4 attention heads / 2 KV
    heads (head_dim 16), intermediate size 128, 2048 positions, untied
    embeddings, float32 safetensors, plus ``generation_config.json`` whose
    ``eos_token_id`` is ``[<|im_end|>, <|endoftext|>]``.

``tiny-qwen2-vl`` (:data:`VL_MODEL`, :func:`build_vl_model`)
    ``Qwen2VLForConditionalGeneration`` with the same text part, a one-layer
    vision tower (embed_dim 32, 2 heads, patch 14, spatial merge 2, temporal
    patch 2), ``mrope_section`` ``[2, 3, 3]`` (sums to head_dim / 2) and a
    ``preprocessor_config.json`` for ``Qwen2VLImageProcessor`` limited to
    ``56*56 <= pixels <= 28*28*64`` so images stay tiny (at most 64 merged
    image tokens).

``tiny-qwen2-d64`` and ``tiny-qwen2-vl-d64`` (:data:`TEXT_MODEL_D64`, :data:`VL_MODEL_D64`)
    The same two models with a text part of hidden size 128, 2 attention heads / 1 KV head
    (head_dim 64), intermediate size 256 and (VL) ``mrope_section`` ``[8, 12, 12]``: vLLM's CPU
    attention refuses head_dim 16, so these are the ones both engine backends load.

``tiny-qwen2-vl-smg`` (:data:`SMG_VL_MODEL`)
    ``tiny-qwen2-vl`` whose image pad token is ``<image>`` (a special token, id 1013; vocab 1014):
    its template renders an image part as ``<|vision_start|><image><|vision_end|>`` and its config
    names the token as ``image_token_id`` and ``vision_token_id``, which is what SMG's Qwen2-VL
    preprocessing expects of a checkpoint (:data:`SMG_IMAGE_TOKEN`); render, the engine and HF read
    the same files unchanged.

``tiny-qwen2-h256`` (:data:`BENCH_TEXT_MODEL`)
    The text model at the engine benchmarks' size: hidden 256, 4 layers, 4 heads / 2 KV heads
    (head_dim 64), intermediate 1024; big enough that a step's arithmetic, not Python, dominates.

``tiny-gemma3`` (:data:`INTERLEAVED_VL_MODEL`, :func:`build_interleaved_vl_model`)
    ``Gemma3ForConditionalGeneration``, the *interleaved-span* VL model: an
    image's placeholder span mixes boundary tokens with the positions that take
    encoder output, so render must send an ``is_embed`` mask.  Text part:
    hidden 64, 2 layers (one ``sliding_attention`` with window 512, one
    ``full_attention``), 4 heads / 2 KV heads, head_dim 16, intermediate 128,
    untied embeddings (a tied random head just echoes its input token).  Vision
    tower: SigLIP, 1 layer, hidden 32, 2 heads, 64 x 64 px images in 8 x 8
    patches (an 8 x 8 grid), average-pooled 2 x 2 into
    ``mm_tokens_per_image = 16`` rows, projected to 64.  Image processor:
    ``Gemma3ImageProcessor`` (``AutoImageProcessor`` gives the PIL backend
    ``Gemma3ImageProcessorPil``: no torchvision needed), resize to 64 x 64,
    mean = std = 0.5, pan-and-scan off; output ``pixel_values`` of shape
    ``[num_images, 3, 64, 64]`` and ``num_crops`` (all 0).  ``AutoProcessor``
    also works here (``Gemma3Processor`` has no video processor).

    Its tokenizer (:func:`build_interleaved_vl_tokenizer`) is the shared one
    below plus three special tokens: ``<start_of_image>`` 1013,
    ``<end_of_image>`` 1014, ``<image_soft_token>`` 1015 (vocab 1016).  Its chat
    template (:data:`INTERLEAVED_VL_CHAT_TEMPLATE`) is the shared Qwen3-style
    one (same roles, tools, thinking, stop tokens) except that an image part
    renders as a single ``<start_of_image>`` (Gemma3's own placeholder) and a
    video part is an error.

    **How the prompt span is built** (what ``Gemma3Processor`` does, and what
    ``expand_image_placeholders`` in the tests' ``interleaved_spans`` reproduces): in the *text* rendered by the
    chat template, each ``<start_of_image>`` (the k-th one is image k) is
    replaced by::

        "\\n\\n" + "<start_of_image>" + "<image_soft_token>" * 16 + "<end_of_image>" + "\\n\\n"

    and the whole string is tokenized at once.  The three image tokens are
    special added tokens, so they always become single ids whatever surrounds
    them; the two ``"\\n\\n"`` are ordinary text whose ids depend on the
    neighbouring text (after ``"Look: "`` the pre-tokenizer makes ``" \\n\\n"`` one
    piece), so they are *not* part of the span.  The placeholder span of one image is therefore
    ``[1013] + [1015] * 16 + [1014]`` (offset = position of its
    ``<start_of_image>``, length 18) with ``is_embed`` =
    ``[False] + [True] * 16 + [False]``: exactly the ``<image_soft_token>``
    positions take the image's 16 encoder output rows, in order.
    The tests' ``interleaved_spans.interleaved_image_span`` returns that span (tokens, ids, mask) for
    one image of the processor output, ``find_image_spans`` locates the
    spans in tokenized ids.  Gemma3's forward also takes ``token_type_ids`` (1
    exactly at the ``is_embed`` positions, 0 elsewhere): with it, the soft
    tokens of one image attend to each other bidirectionally; without it
    attention is plainly causal and the output differs (also in
    ``generate()``, silently).  Pan-and-scan (off here) would add crops, each
    a further span with text between them; not supported by these helpers.

``tiny-llama`` (:data:`LLAMA_MODEL`, :func:`build_llama_model`)
    ``LlamaForCausalLM`` with the shared text part (hidden 64, 2 layers, 4 / 2 heads, head_dim
    16, intermediate 128), no biases, untied embeddings and Llama 3.1's rotary scaling
    (:data:`LLAMA_ROPE_PARAMETERS`: ``rope_type`` ``llama3``, factor 8, original context 256, so
    on head_dim 16 some frequencies are scaled fully, some partly, some not at all).

``tiny-llama-d64`` (:data:`LLAMA_MODEL_D64`)
    ``tiny-llama`` with the wide text part (hidden 128, 2 heads / 1 KV head, head_dim 64,
    intermediate 256) and the same rotary scaling (which again scales some frequencies fully,
    some partly, some not at all): vLLM's CPU attention refuses head_dim 16, so this is the Llama
    both engine backends load.

``tiny-qwen3`` (:data:`QWEN3_MODEL`, :func:`build_qwen3_model`)
    ``Qwen3ForCausalLM``: the shared text part with ``head_dim`` 32 (not hidden / heads), per-head
    q/k RMSNorm, no q/k/v bias.

``tiny-qwen2.5-vl`` (:data:`QWEN2_5_VL_MODEL`, :func:`build_qwen2_5_vl_model`)
    ``Qwen2_5_VLForConditionalGeneration``: the text part of ``tiny-qwen2-vl`` and a 2-block
    vision tower (block 0 windowed, ``window_size`` 56 px, block 1 full: ``fullatt_block_indexes``
    [1]; hidden 32, 2 heads, gated SiLU MLP 64, RMSNorm, merger to 64), ``tokens_per_second`` 2,
    and ``tiny-qwen2-vl``'s image processor config (``processor_class`` ``Qwen2_5_VLProcessor``).

``tiny-qwen3-vl`` (:data:`QWEN3_VL_MODEL`, :func:`build_qwen3_vl_model`)
    ``Qwen3VLForConditionalGeneration``: a Qwen3 text part (q/k RMSNorm, no bias) at hidden 64,
    3 layers, 1 head / 1 KV head, head_dim 64 (so vLLM's CPU attention takes it), interleaved
    M-RoPE ``mrope_section`` [12, 10, 10]; a 2-block vision tower (hidden 32, 16-pixel patches, a
    learned 8 x 8 position grid) with DeepStack mergers on blocks 0 and 1, whose outputs are added
    to decoder layers 0 and 1 at the image/video positions. ``preprocessor_config.json``
    (``Qwen2VLImageProcessorFast`` settings, patch 16, mean = std = 0.5, 4..64 merged tokens per
    image) and ``video_preprocessor_config.json`` (``Qwen3VLVideoProcessor``: 4096..131072 pixels
    over all frames, no frame sampling). Its chat template is the shared one, which renders image
    and video parts as Qwen3-VL's does (``<|vision_start|><|image_pad|><|vision_end|>``,
    ``<|vision_start|><|video_pad|><|vision_end|>``).

These four use the shared tokenizer, chat template and generation config unchanged.

The directories share one tokenizer (:func:`build_tokenizer`): a byte-level
BPE with the Qwen2 pre-tokenizer regex, NFC normalisation and a ~1000 token
vocabulary, followed by these added tokens (ids are fixed by the build)::

    <|endoftext|>    1000  special (pad token, also a stop token)
    <|im_start|>     1001  special
    <|im_end|>       1002  special (eos token)
    <|vision_start|> 1003  special
    <|vision_end|>   1004  special
    <|image_pad|>    1005  special
    <|video_pad|>    1006  special
    <tool_call>      1007  not special
    </tool_call>     1008  not special
    <tool_response>  1009  not special
    </tool_response> 1010  not special
    <think>          1011  not special
    </think>         1012  not special

for a total of 1013 tokens (``len(tokenizer)`` equals the models' vocab size;
``tiny-gemma3`` appends its three image tokens, see above).

Notes on transformers 5.x (checked against 5.24):

* ``AutoTokenizer`` maps ``tokenizer_class: "Qwen2Tokenizer"`` to the
  ``tokenizers``-backed class.  Because ``Qwen2Tokenizer`` defines its own
  ``__init__``, transformers does *not* load ``tokenizer.json`` verbatim: it
  takes vocab, merges and post-processor from the file and rebuilds the
  normaliser / pre-tokenizer / decoder from the class.  The pipeline trained
  here is therefore exactly Qwen2's (NFC, the Qwen2 split regex, ByteLevel
  without regex, ByteLevel decoder) so both ways of loading encode alike.
* The chat template is written to ``chat_template.jinja``.  transformers 5.x
  reads that file (when present it overrides any ``chat_template`` key in
  ``tokenizer_config.json``) and ``save_pretrained`` writes it there too, so
  ``tokenizer_config.json`` carries no template.
* ``apply_chat_template`` drops message keys whose value is ``None`` before
  rendering, so the template treats a missing ``content`` as empty.  It also
  returns a ``BatchEncoding`` by default (``return_dict=True``) when
  tokenizing; pass ``return_dict=False`` for a plain list of ids.
* Qwen2-VL config field names: the text settings live in ``text_config``
  (``Qwen2VLTextConfig``; ``rope_parameters`` holds ``rope_theta``,
  ``rope_type`` and ``mrope_section``; ``"mrope"`` is normalised to
  ``"default"``), the vision tower in ``vision_config``
  (``Qwen2VLVisionConfig``: ``depth``, ``embed_dim``, ``num_heads``,
  ``hidden_size`` = output size of the patch merger = text hidden size,
  ``mlp_ratio``, ``patch_size``, ``spatial_merge_size``,
  ``temporal_patch_size``), and ``image_token_id`` / ``video_token_id`` /
  ``vision_start_token_id`` / ``vision_end_token_id`` /
  ``tie_word_embeddings`` on the top-level config.
* Qwen2-VL forward **requires** ``mm_token_type_ids`` (same shape as
  ``input_ids``; 0 = text, 1 = image token, 2 = video token) whenever
  ``image_grid_thw`` / ``video_grid_thw`` is passed together with
  ``input_ids``: without it ``compute_3d_position_ids`` raises ``ValueError``
  ("Multimodal data was passed ... but `mm_token_type_ids` is missing").  It is
  used to find the vision spans for M-RoPE.  ``generate()`` does *not* raise
  in that case: it silently falls back to plain 1-D positions for the vision
  tokens (different, wrong output), so always pass it.  Text-only inputs need
  no ``mm_token_type_ids``.  The processor would normally
  return it, but ``AutoProcessor`` for Qwen2-VL needs torchvision (for the
  video processor); ``AutoImageProcessor`` works without it (it falls back to
  ``Qwen2VLImageProcessorPil``).  Callers expand each ``<|image_pad|>`` to
  ``image_grid_thw[i].prod() // merge_size**2`` copies themselves and set
  ``mm_token_type_ids`` to 1 at those positions.
* ``save_pretrained`` of ``Qwen2VLForConditionalGeneration`` writes the
  original checkpoint key layout (``model.layers.*``, ``visual.*``,
  ``lm_head.*``) although the in-memory modules are
  ``model.language_model.*`` / ``model.visual.*``; loading maps them back.
* In the image processor, ``min_pixels`` / ``max_pixels`` are stored as
  ``size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}``; the
  written ``preprocessor_config.json`` carries both spellings so that older
  transformers versions read the same limits.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import threading
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "TEXT_MODEL",
    "VL_MODEL",
    "PADDED_TEXT_MODEL",
    "BENCH_TEXT_MODEL",
    "PADDED_VOCAB_ROWS",
    "INTERLEAVED_VL_MODEL",
    "MODELS",
    "VERSION",
    "SPECIAL_TOKENS",
    "NON_SPECIAL_ADDED_TOKENS",
    "CHAT_TEMPLATE",
    "build_tokenizer",
    "build_text_model",
    "build_vl_model",
    "build_interleaved_vl_model",
    "build_llama_model",
    "build_qwen3_model",
    "build_qwen2_5_vl_model",
    "LLAMA_MODEL",
    "LLAMA_MODEL_D64",
    "QWEN3_MODEL",
    "QWEN2_5_VL_MODEL",
    "QWEN3_VL_MODEL",
    "SMG_VL_MODEL",
    "SMG_IMAGE_TOKEN",
    "build_qwen3_vl_model",
    "build_interleaved_vl_tokenizer",
    "INTERLEAVED_VL_CHAT_TEMPLATE",
    "INTERLEAVED_VL_SPECIAL_TOKENS",
    "ensure_model",
    "main",
]

TEXT_MODEL = "tiny-qwen2"
VL_MODEL = "tiny-qwen2-vl"
INTERLEAVED_VL_MODEL = "tiny-gemma3"
TEXT_MODEL_D64 = "tiny-qwen2-d64"
VL_MODEL_D64 = "tiny-qwen2-vl-d64"
LLAMA_MODEL = "tiny-llama"
LLAMA_MODEL_D64 = "tiny-llama-d64"
QWEN3_MODEL = "tiny-qwen3"
QWEN2_5_VL_MODEL = "tiny-qwen2.5-vl"
QWEN3_VL_MODEL = "tiny-qwen3-vl"
#: tiny-qwen2-vl with the image placeholder SMG's Qwen2-VL preprocessing expects (SMG_IMAGE_TOKEN).
SMG_VL_MODEL = "tiny-qwen2-vl-smg"
#: SMG (1.13)'s `qwen_vl` spec takes a Qwen2-VL prompt's image anchor to be the token "<image>"
#: (refusing a tokenizer without it), finds one per image in the rendered prompt and repeats the
#: config's `vision_token_id` in its place: a checkpoint SMG serves names that token in its
#: template, as its image_token_id and as its vision_token_id.
SMG_IMAGE_TOKEN = "<image>"
#: tiny-qwen2 with a padded embedding (PADDED_VOCAB_ROWS rows for the same 1013-entry tokenizer),
#: as real checkpoints have (Qwen: 151,936 rows, 151,669 tokens): ids 1013..1087 are padding ids.
PADDED_TEXT_MODEL = "tiny-qwen2-padded"
#: The engine benchmarks' model (bench/engine.py --vllm / --pipeline): the Qwen2 layout at hidden
#: 256, 4 layers, 4 heads / 2 KV heads (head_dim 64, as vLLM's CPU attention needs), intermediate 1024.
BENCH_TEXT_MODEL = "tiny-qwen2-h256"
BENCH_TEXT_SHAPE = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
                    "num_attention_heads": 4, "num_key_value_heads": 2}
MODELS = (TEXT_MODEL, VL_MODEL, INTERLEAVED_VL_MODEL, TEXT_MODEL_D64, VL_MODEL_D64, LLAMA_MODEL, QWEN3_MODEL,
          QWEN2_5_VL_MODEL, QWEN3_VL_MODEL, PADDED_TEXT_MODEL, BENCH_TEXT_MODEL, SMG_VL_MODEL, LLAMA_MODEL_D64)

#: Bump whenever the produced bytes change, so cached copies are rebuilt.
VERSION = "v1"

#: Size of the trained byte-level BPE vocabulary (added tokens come after it).
BPE_VOCAB_SIZE = 1000
SEED = 1234
INITIALIZER_RANGE = 0.2
#: Embedding rows of PADDED_TEXT_MODEL: the tokenizer's 1013 entries rounded up to 17 x 64.
PADDED_VOCAB_ROWS = 1088

#: Special added tokens, in id order (first id == BPE_VOCAB_SIZE).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
#: Non-special added tokens (kept by ``decode(skip_special_tokens=True)``).
NON_SPECIAL_ADDED_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Same split regex as transformers' Qwen2Tokenizer (PRETOKENIZE_REGEX).
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Fixed training corpus: varied English prose, code, JSON, numbers, punctuation,
# chat/tool phrasing and some non-ASCII text.  Changing it changes every id, so its long lines
# stay whole (the noqa at its end).
_CORPUS = r'''
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Hello, world! How are you today? I am fine, thank you. What time is it? It is 10:45 in the morning.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife.
Every morning he walked down to the harbour, checked the weather, and pushed his boat into the water.
The sun was shining, the birds were singing, and the children were playing in the park.
Please answer the question below. Think step by step, then give the final answer.
The answer is 42. The result is correct. That is not what I expected, but it works.
Yesterday we visited the museum; tomorrow we will go to the library, and on Friday we rest.
She said: "I don't know." He replied, "Let's find out!" They couldn't agree, so they asked a friend.
It's a beautiful day -- isn't it? We'll see. You're right; they've already left, and I'd stay.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 3.14159 2.71828 -7 +15 1e-5 50% $19.99 #1
Dates and times: 2024-01-15, 12/31/1999, 08:30 AM, 23:59:59, Monday, March 3rd, the 21st century.
Math: 2 + 2 = 4; 3 * 7 = 21; 10 / 4 = 2.5; x^2 + y^2 = z^2; a <= b && b >= c || !d; f(x) = 3x + 1.
Punctuation: commas, periods. Question marks? Exclamation marks! Colons: semicolons; (parentheses) [brackets] {braces} <angles> 'quotes' "double quotes" `backticks` ~tilde @at #hash %percent ^caret &amp *star _under -dash +plus =equals |pipe \backslash /slash...
You are a helpful assistant. The user asks a question and the assistant answers it politely.
The system message sets the rules. The assistant may call a tool; the tool returns a response.
You may call one or more functions to assist with the user query.
You are provided with function signatures within XML tags.
For each function call, return a json object with function name and arguments within XML tags.
The weather in Paris is sunny with a high of 22 degrees. The weather in Tokyo is rainy and cool.
Search results: three documents were found. The first document describes the history of the city.
The model generates one token at a time. Each token has an id. Tokens are decoded back into text.
def add(a, b):
    """Return the sum of a and b."""
    return a + b

def get_weather(city: str, unit: str = "celsius") -> dict:
    if not city:
        raise ValueError("city must not be empty")
    return {"city": city, "temperature": 22, "unit": unit}

class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, step=1):
        self.value += step
        return self.value

for i in range(10):
    print(f"item {i}: {i * i}")

import json, os, sys
data = json.loads('{"key": "value", "list": [1, 2, 3]}')
with open("output.txt", "w", encoding="utf-8") as handle:
    handle.write(str(data))

function greet(name) {
  const message = `Hello, ${name}!`;
  console.log(message);
  return message.length;
}

if (x > 0 && y < 10) { return true; } else { return null; }
SELECT id, name, email FROM users WHERE age >= 18 ORDER BY name LIMIT 10;
$ pip install tito && tito serve --port 50051 --model tiny-qwen2
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"name": "search", "arguments": {"query": "tiny language models", "max_results": 5}}
{"type": "function", "function": {"name": "get_time", "description": "Get the current time in a timezone.", "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "description": "An IANA timezone name"}}, "required": ["timezone"]}}}
{"role": "user", "content": "What is the weather like?"}
{"role": "assistant", "content": null, "tool_calls": [{"id": "call_0", "type": "function"}]}
{"role": "tool", "content": "{\"temperature\": 22, \"condition\": \"sunny\"}"}
{"id": 7, "ok": true, "error": null, "values": [0.5, 1.25, -3], "nested": {"a": [], "b": {}}}
<html><body><p class="note">A short paragraph.</p><a href="https://example.com/path?q=1&x=2">link</a></body></html>
# Heading
## Subheading
- first item
- second item
1. step one
2. step two
**bold** and *italic* and `code`.
The café on the corner serves crème brûlée, jalapeño nachos and a naïve piña colada.
Grüße aus München! Ça va? ¿Qué tal? Señor Müller wohnt in Zürich. Æsir, Øresund, Åland.
Привет, мир! Γειά σου κόσμε! שלום עולם! مرحبا بالعالم
日本語のテキスト。日本、東京、こんにちは世界。中文：你好，世界！한국어: 안녕하세요
Emoji: 😀 🎉 🚀 👍 ❤️ 🐍 ☕ ✨ 🌍 — and symbols: © ® ™ € £ ¥ ° ± × ÷ → ← ↑ ↓ … « » “ ” ‘ ’
Tabs	and	spaces    and
newlines

and blank lines end here.
'''  # noqa: E501


_VISION_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
_VISION_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"

#: Qwen3-style chat template (tools, tool calls, tool responses, thinking,
#: ``enable_thinking``) with Qwen2-VL style multimodal content parts. Its long lines are written
#: as in Qwen3's template and kept whole, so the two compare line by line (the noqa at its end).
CHAT_TEMPLATE = (
    r"""{%- macro render_content(content) -%}
    {%- if content is none or content is undefined -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- elif content is mapping -%}
        {{- raise_exception('Message content must be a string or a list of content parts') -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part.type == 'text' or (part.type is not defined and 'text' in part) -%}
                {{- part.text -}}
            {%- elif part.type in ['image', 'image_url'] or 'image' in part or 'image_url' in part -%}
                {{- '"""
    + _VISION_IMAGE
    + r"""' -}}
            {%- elif part.type in ['video', 'video_url'] or 'video' in part or 'video_url' in part -%}
                {{- '"""
    + _VISION_VIDEO
    + r"""' -}}
            {%- else -%}
                {{- raise_exception('Unsupported content part type: ' ~ part.type) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- raise_exception('Message content must be a string or a list of content parts') -}}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- render_content(messages[0].content) + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set query = render_content(message.content) %}
        {%- if not (query.startswith('<tool_response>') and query.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = render_content(message.content) %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}
            {{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' ~ message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""  # noqa: E501
)

# --------------------------------------------------------------------------- helpers


def _write_text(path: Path, text: str) -> None:
    # newline="" keeps "\n" on every platform, so the bytes never depend on the OS.
    with open(path, "w", encoding="utf-8", newline="") as handle:
        handle.write(text)


def _write_json(path: Path, obj: Any) -> None:
    _write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _added_token_ids() -> dict[str, int]:
    tokens = SPECIAL_TOKENS + NON_SPECIAL_ADDED_TOKENS
    return {token: BPE_VOCAB_SIZE + index for index, token in enumerate(tokens)}


def _vocab_size() -> int:
    return BPE_VOCAB_SIZE + len(SPECIAL_TOKENS) + len(NON_SPECIAL_ADDED_TOKENS)


def _corpus_lines() -> list[str]:
    # Keep line endings so the trainer sees newline/indent tokens too.
    return _CORPUS.strip("\n").splitlines(keepends=True)


# --------------------------------------------------------------------------- tokenizer


def train_bpe():
    """The shared byte-level BPE (Qwen2's pipeline, :data:`BPE_VOCAB_SIZE` tokens) trained on the
    embedded corpus, without added tokens: ids 0..999 of every tokenizer built here."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE

    tokenizer = Tokenizer(
        BPE(
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer=trainer, length=None)
    trained = tokenizer.get_vocab_size(with_added_tokens=False)
    if trained != BPE_VOCAB_SIZE:
        raise RuntimeError(f"BPE training produced {trained} tokens, expected {BPE_VOCAB_SIZE}; enlarge the corpus")

    return tokenizer


def _train_backend_tokenizer(extra_special_tokens: tuple[str, ...] = (), extra_tokens: tuple[str, ...] = ()):
    """Train the shared BPE and add the tokens of :func:`_added_token_ids`.

    ``extra_special_tokens`` are appended after them (ids from 1013 on), then ``extra_tokens``
    (not special), for a model variant that needs more tokens; the first 1013 ids never change.
    """
    from tokenizers import AddedToken

    tokenizer = train_bpe()

    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)
            for t in SPECIAL_TOKENS
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False, lstrip=False, rstrip=False, single_word=False)
            for t in NON_SPECIAL_ADDED_TOKENS
        ]
    )
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS + NON_SPECIAL_ADDED_TOKENS}
    if ids != _added_token_ids():
        raise RuntimeError(f"unexpected added token ids: {ids}")
    if extra_special_tokens:
        tokenizer.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)
                for t in extra_special_tokens
            ]
        )
        extra_ids = [tokenizer.token_to_id(token) for token in extra_special_tokens]
        if extra_ids != list(range(_vocab_size(), _vocab_size() + len(extra_special_tokens))):
            raise RuntimeError(f"unexpected extra special token ids: {extra_ids}")
    if extra_tokens:
        first = _vocab_size() + len(extra_special_tokens)
        tokenizer.add_tokens(
            [
                AddedToken(t, special=False, normalized=False, lstrip=False, rstrip=False, single_word=False)
                for t in extra_tokens
            ]
        )
        extra_ids = [tokenizer.token_to_id(token) for token in extra_tokens]
        if extra_ids != list(range(first, first + len(extra_tokens))):
            raise RuntimeError(f"unexpected extra token ids: {extra_ids}")
    return tokenizer


def _tokenizer_config(added_token_ids: Mapping[str, int] | None = None) -> dict[str, Any]:
    """``tokenizer_config.json`` for the added tokens at ``added_token_ids`` (default: this module's)."""
    added_tokens_decoder = {}
    for token, token_id in (added_token_ids or _added_token_ids()).items():
        added_tokens_decoder[str(token_id)] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in SPECIAL_TOKENS,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        # transformers 5.x reads this (deprecated) name as ``extra_special_tokens``; 4.x reads it natively.
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != PAD_TOKEN],
        "model_max_length": 2048,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def build_tokenizer(out_dir: Path) -> Path:
    """Train the tiny byte-level BPE tokenizer and write it into ``out_dir``.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` and
    ``chat_template.jinja``; returns ``out_dir``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_backend_tokenizer()
    _write_text(out_dir / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n")
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config())
    _write_text(out_dir / "chat_template.jinja", CHAT_TEMPLATE)
    return out_dir


# --------------------------------------------------------------------------- models


def _text_settings(head_dim: int = 16, vocab_rows: int | None = None) -> dict[str, Any]:
    """The text part: head_dim 16 (hidden 64, 4 / 2 heads) or 64 (hidden 128, 2 / 1 heads);
    `vocab_rows` embedding rows (default: exactly the tokenizer's entries)."""
    ids = _added_token_ids()
    wide = head_dim == 64
    return {
        "vocab_size": vocab_rows or _vocab_size(),
        "hidden_size": 128 if wide else 64,
        "intermediate_size": 256 if wide else 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2 if wide else 4,
        "num_key_value_heads": 1 if wide else 2,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "initializer_range": INITIALIZER_RANGE,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[PAD_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
    }


def _write_generation_config(out_dir: Path) -> None:
    ids = _added_token_ids()
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": ids[PAD_TOKEN],
            "do_sample": False,
            "eos_token_id": [ids[EOS_TOKEN], ids[PAD_TOKEN]],
            "pad_token_id": ids[PAD_TOKEN],
        },
    )


def _save_model(model, out_dir: Path) -> None:
    from transformers.utils import logging as hf_logging

    # save_pretrained shows a "Writing model shards" progress bar; keep builds quiet.
    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        # Writes the original (pre-v5) checkpoint key layout, e.g. ``model.layers.*`` / ``visual.*``.
        model.save_pretrained(out_dir, safe_serialization=True)
    finally:
        if bar_was_enabled:
            hf_logging.enable_progress_bar()
    # Re-write config.json sorted (transformers already sorts; this pins it) and replace the
    # generation config transformers derived from the model config with ours.
    config_path = out_dir / "config.json"
    _write_json(config_path, _read_json(config_path))
    _write_generation_config(out_dir)
    # safetensors files come out as 0600; make them as readable as the other files.
    os.chmod(out_dir / "model.safetensors", 0o644)


def _prefix_weights(path: Path, prefix: str, replacement: str) -> None:
    """Rename the weights of a safetensors file whose names start with `prefix`."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path)
    save_file({replacement + name[len(prefix):] if name.startswith(prefix) else name: tensor
               for name, tensor in weights.items()}, path, metadata={"format": "pt"})
    os.chmod(path, 0o644)  # as _save_model leaves it


# Module kinds (class names) that _deterministic_init treats specially; none occurs in the Qwen models.
_ZERO_CENTRED_NORMS = frozenset({"Gemma3RMSNorm"})
_RAW_MATRIX_MODULES = frozenset({"Gemma3MultiModalProjector"})

# Building sets torch's global default dtype for a moment, so builds in one
# process are serialised (e.g. ensure_model called from several threads).
_BUILD_LOCK = threading.RLock()


def _deterministic_init(model) -> None:
    """Re-initialise every parameter from private, per-parameter seeded generators.

    Mirrors transformers' own init for these architectures (normal(0, std) for
    Linear / Conv / Embedding weights, zero biases, unit norm weights) but does
    not touch torch's global RNG and does not depend on module order, so the
    weights only depend on parameter names and shapes.
    """
    import torch
    from torch import nn

    with torch.no_grad():
        for module_name, module in model.named_modules():
            params = dict(module.named_parameters(recurse=False))
            if not params:
                continue
            kind = type(module).__name__
            if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
                for param_name, param in params.items():
                    if param_name == "bias":
                        param.zero_()
                    else:
                        full_name = f"{module_name}.{param_name}"
                        generator = torch.Generator().manual_seed(SEED + zlib.crc32(full_name.encode()))
                        param.normal_(0.0, INITIALIZER_RANGE, generator=generator)
            elif kind in _ZERO_CENTRED_NORMS:
                # These norms scale by (1 + weight): zero is their identity.
                for param in params.values():
                    param.zero_()
            elif "Norm" in kind:
                for param_name, param in params.items():
                    param.fill_(0.0 if param_name == "bias" else 1.0)
            elif kind in _RAW_MATRIX_MODULES:
                # Plain nn.Parameter matrices (not inside a Linear); transformers zero-inits some of
                # them (Gemma3's image projection), which would make images invisible to the model.
                for param_name, param in params.items():
                    full_name = f"{module_name}.{param_name}"
                    generator = torch.Generator().manual_seed(SEED + zlib.crc32(full_name.encode()))
                    param.normal_(0.0, INITIALIZER_RANGE, generator=generator)
            else:
                raise RuntimeError(f"no deterministic init for {module_name} ({kind})")


def _create_model(model_cls, config):
    """Instantiate ``model_cls(config)`` in float32 with deterministic weights."""
    import torch

    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):  # construction's random init is discarded
        previous_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            model = model_cls(config)
        finally:
            torch.set_default_dtype(previous_dtype)
    model = model.to(torch.float32).eval()
    _deterministic_init(model)
    return model


def build_text_model(out_dir: Path, head_dim: int = 16, vocab_rows: int | None = None,
                     shape: dict[str, int] | None = None) -> Path:
    """Write the tokenizer, a tiny random ``Qwen2ForCausalLM`` and its generation config.
    ``vocab_rows`` pads the embedding and LM head past the tokenizer (rows the tokenizer does
    not name: padding ids); ``shape`` overrides sizes of the text settings (hidden size, layers,
    heads); the weights of every parameter are seeded by its name alone."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    build_tokenizer(out_dir)
    config = Qwen2Config(
        **{**_text_settings(head_dim, vocab_rows), **(shape or {})},
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        dtype="float32",
    )
    config.architectures = ["Qwen2ForCausalLM"]
    model = _create_model(Qwen2ForCausalLM, config)
    _save_model(model, out_dir)
    return out_dir


def _image_processor_config() -> dict[str, Any]:
    min_pixels = 56 * 56
    max_pixels = 28 * 28 * 64
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_processor_type": "Qwen2VLImageProcessor",
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "max_pixels": max_pixels,
        "merge_size": 2,
        "min_pixels": min_pixels,
        "patch_size": 14,
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"longest_edge": max_pixels, "shortest_edge": min_pixels},
        "temporal_patch_size": 2,
    }


def _build_smg_anchor_tokenizer(out_dir: Path) -> int:
    """The shared tokenizer plus :data:`SMG_IMAGE_TOKEN` (special, id 1013), and the shared chat
    template with an image part rendered as ``<|vision_start|><image><|vision_end|>``; returns the
    new token's id."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_backend_tokenizer(extra_special_tokens=(SMG_IMAGE_TOKEN,))
    image_id = _vocab_size()
    _write_text(out_dir / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n")
    config = _tokenizer_config()
    config["added_tokens_decoder"][str(image_id)] = {"content": SMG_IMAGE_TOKEN, "lstrip": False, "normalized": False,
                                                     "rstrip": False, "single_word": False, "special": True}
    config["additional_special_tokens"] = config["additional_special_tokens"] + [SMG_IMAGE_TOKEN]
    config["image_token"] = SMG_IMAGE_TOKEN  # Qwen2VLProcessor's image token, as the config's image_token_id
    _write_json(out_dir / "tokenizer_config.json", config)
    template = CHAT_TEMPLATE.replace(_VISION_IMAGE, "<|vision_start|>" + SMG_IMAGE_TOKEN + "<|vision_end|>")
    assert template != CHAT_TEMPLATE
    _write_text(out_dir / "chat_template.jinja", template)
    return image_id


def build_vl_model(out_dir: Path, head_dim: int = 16, smg_anchor: bool = False) -> Path:
    """Write the tokenizer, a tiny random ``Qwen2VLForConditionalGeneration`` and an image processor
    config. ``smg_anchor``: the image pad token is :data:`SMG_IMAGE_TOKEN` (tiny-qwen2-vl-smg)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    out_dir = Path(out_dir)
    ids = _added_token_ids()
    if smg_anchor:
        image_id, vocab_rows = _build_smg_anchor_tokenizer(out_dir), _vocab_size() + 1
    else:
        build_tokenizer(out_dir)
        image_id, vocab_rows = ids["<|image_pad|>"], None
    # M-RoPE splits head_dim / 2 rotary frequencies into (t, h, w) sections.
    mrope_section = [8, 12, 12] if head_dim == 64 else [2, 3, 3]
    text_config = dict(
        _text_settings(head_dim, vocab_rows),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section},
    )
    vision_config = {
        "depth": 1,
        "embed_dim": 32,
        "hidden_size": text_config["hidden_size"],
        "hidden_act": "quick_gelu",
        "mlp_ratio": 2,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "initializer_range": INITIALIZER_RANGE,
    }
    config = Qwen2VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=image_id,
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )
    if smg_anchor:
        config.vision_token_id = image_id  # what SMG repeats in place of each <image>
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    model = _create_model(Qwen2VLForConditionalGeneration, config)
    _save_model(model, out_dir)
    _write_json(out_dir / "preprocessor_config.json", _image_processor_config())
    return out_dir


# --------------------------------------------------------------------------- more text families


#: Llama 3.1's rotary scaling (rope_type "llama3") with a small original context, so that on
#: head_dim 16 the scaling changes some frequencies fully, some partly and leaves the fastest alone.
LLAMA_ROPE_PARAMETERS = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


def _plain_text_settings(head_dim: int = 16) -> dict[str, Any]:
    """The shared text part (head_dim 16 or 64) without the Qwen2-only sliding-window switch."""
    settings = _text_settings(head_dim)
    del settings["use_sliding_window"]
    return settings


def build_llama_model(out_dir: Path, head_dim: int = 16) -> Path:
    """Write the tokenizer and a tiny random ``LlamaForCausalLM`` (Llama 3.1-style rotary scaling,
    GQA, no biases, untied embeddings; head_dim 16, or 64 for vLLM's CPU attention) with the shared
    tokenizer and generation config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    build_tokenizer(out_dir)
    config = LlamaConfig(**_plain_text_settings(head_dim), tie_word_embeddings=False, attention_bias=False,
                         mlp_bias=False, rope_parameters=dict(LLAMA_ROPE_PARAMETERS), dtype="float32")
    config.architectures = ["LlamaForCausalLM"]
    _save_model(_create_model(LlamaForCausalLM, config), out_dir)
    return out_dir


def build_qwen3_model(out_dir: Path) -> Path:
    """Write the tokenizer and a tiny random ``Qwen3ForCausalLM``: per-head q/k RMSNorm, no q/k/v
    bias, and ``head_dim`` 32 from the config (not hidden_size / heads = 16)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    build_tokenizer(out_dir)
    config = Qwen3Config(**_text_settings(), head_dim=32, attention_bias=False, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, dtype="float32")
    config.architectures = ["Qwen3ForCausalLM"]
    _save_model(_create_model(Qwen3ForCausalLM, config), out_dir)
    return out_dir


#: Qwen2.5-VL's vision window in pixels: 56 = 2 x 2 merged patches of 28 pixels per window, so any
#: image wider or taller than 56 pixels is split into several windows.
QWEN2_5_VL_WINDOW_SIZE = 56
#: Temporal rotary positions per second of video (Qwen2.5-VL's M-RoPE time axis).
QWEN2_5_VL_TOKENS_PER_SECOND = 2


def build_qwen2_5_vl_model(out_dir: Path, head_dim: int = 16) -> Path:
    """Write the tokenizer, a tiny random ``Qwen2_5_VLForConditionalGeneration`` and its image
    processor config (Qwen2.5-VL uses ``Qwen2VLImageProcessor``; same bounds as ``tiny-qwen2-vl``).

    Vision tower: 2 blocks (block 0 attends within windows of ``QWEN2_5_VL_WINDOW_SIZE`` pixels,
    block 1 over the whole image: ``fullatt_block_indexes`` [1]), hidden 32, 2 heads, SwiGLU MLP of
    64, RMSNorm, merger to the text hidden size; ``tokens_per_second`` 2. Text part: the shared
    one with ``mrope_section`` [2, 3, 3]; with ``head_dim`` 64 the wide one (hidden 128, what vLLM's
    CPU attention needs) with [8, 12, 12].
    """
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    out_dir = Path(out_dir)
    build_tokenizer(out_dir)
    ids = _added_token_ids()
    text_config = dict(
        _text_settings(head_dim),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": [8, 12, 12] if head_dim == 64 else [2, 3, 3]},
    )
    vision_config = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "hidden_act": "silu",
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "tokens_per_second": QWEN2_5_VL_TOKENS_PER_SECOND,
        "window_size": QWEN2_5_VL_WINDOW_SIZE,
        "fullatt_block_indexes": [1],
        "out_hidden_size": text_config["hidden_size"],
        "initializer_range": INITIALIZER_RANGE,
    }
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    _save_model(_create_model(Qwen2_5_VLForConditionalGeneration, config), out_dir)
    _write_json(out_dir / "preprocessor_config.json",
                dict(_image_processor_config(), processor_class="Qwen2_5_VLProcessor"))
    return out_dir


#: Qwen3-VL's M-RoPE sections for head_dim 64 (Qwen3-VL's [24, 20, 20] for head_dim 128, halved
#: and rounded so they sum to 32), interleaved (t, h, w, t, h, w, ...) across the rotary dims.
QWEN3_VL_MROPE_SECTION = [12, 10, 10]
#: The vision blocks whose outputs DeepStack adds to the first decoder layers (one per layer).
QWEN3_VL_DEEPSTACK_INDEXES = [0, 1]
QWEN3_VL_PATCH_SIZE = 16


def _qwen3_vl_image_processor_config() -> dict[str, Any]:
    # Qwen3-VL ships Qwen2VLImageProcessorFast settings with 16-pixel patches and mean = std = 0.5;
    # AutoImageProcessor gives the PIL backend here. Bounds keep images tiny (4..64 merged tokens).
    min_pixels, max_pixels = 32 * 32 * 4, 32 * 32 * 64
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "image_std": [0.5, 0.5, 0.5],
        "merge_size": 2,
        "patch_size": QWEN3_VL_PATCH_SIZE,
        "processor_class": "Qwen3VLProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"longest_edge": max_pixels, "shortest_edge": min_pixels},
        "temporal_patch_size": 2,
    }


def _qwen3_vl_video_processor_config() -> dict[str, Any]:
    # Qwen3VLVideoProcessor: the pixel budget covers the whole (temporally padded) video, so a
    # longer video gets smaller frames; 4 frames of 64 x 64 stay within it.
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "do_sample_frames": False,
        "fps": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "merge_size": 2,
        "patch_size": QWEN3_VL_PATCH_SIZE,
        "processor_class": "Qwen3VLProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"longest_edge": 32 * 32 * 128, "shortest_edge": 32 * 32 * 4},
        "temporal_patch_size": 2,
        "video_processor_type": "Qwen3VLVideoProcessor",
    }


def build_qwen3_vl_model(out_dir: Path) -> Path:
    """Write the tokenizer, a tiny random ``Qwen3VLForConditionalGeneration`` and its image and
    video processor configs (``preprocessor_config.json``, ``video_preprocessor_config.json``).

    Text part: Qwen3 (per-head q/k RMSNorm, no bias) at hidden 64, 3 layers, 1 head / 1 KV head,
    head_dim 64 (vLLM's CPU attention takes it), interleaved M-RoPE ``mrope_section``
    :data:`QWEN3_VL_MROPE_SECTION`. Vision tower: 2 blocks, hidden 32, 2 heads, GELU-tanh MLP 64,
    16-pixel patches, temporal patch 2, spatial merge 2, a learned 8 x 8 position grid
    (``num_position_embeddings`` 64, bilinearly resampled per image), merger to 64, and DeepStack
    mergers on blocks :data:`QWEN3_VL_DEEPSTACK_INDEXES` (their outputs are added to the hidden
    states of decoder layers 0 and 1 at the image positions; layer 2 gets none).
    """
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    out_dir = Path(out_dir)
    build_tokenizer(out_dir)
    ids = _added_token_ids()
    text_config = dict(
        _text_settings(head_dim=64),
        # hidden 64 with one head of 64: logits small enough (|logit| < 5) that float32 noise
        # stays well inside the 1e-5 the engine's per-step logits are held to against HF.
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=1,
        num_key_value_heads=1,
        num_hidden_layers=3,
        head_dim=64,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": QWEN3_VL_MROPE_SECTION,
                         "mrope_interleaved": True},
    )
    del text_config["use_sliding_window"]
    vision_config = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "patch_size": QWEN3_VL_PATCH_SIZE,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": list(QWEN3_VL_DEEPSTACK_INDEXES),
        "out_hidden_size": text_config["hidden_size"],
        "initializer_range": INITIALIZER_RANGE,
    }
    config = Qwen3VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    _save_model(_create_model(Qwen3VLForConditionalGeneration, config), out_dir)
    _write_json(out_dir / "preprocessor_config.json", _qwen3_vl_image_processor_config())
    _write_json(out_dir / "video_preprocessor_config.json", _qwen3_vl_video_processor_config())
    return out_dir


# --------------------------------------------------------------------------- interleaved-span VL model (Gemma3)

IMAGE_BEGIN_TOKEN = "<start_of_image>"
IMAGE_END_TOKEN = "<end_of_image>"
#: The position that takes one encoder output row.
IMAGE_SOFT_TOKEN = "<image_soft_token>"
#: Gemma3's image tokens, appended to the shared tokenizer for ``tiny-gemma3`` only (ids 1013..1015).
INTERLEAVED_VL_SPECIAL_TOKENS = (IMAGE_BEGIN_TOKEN, IMAGE_END_TOKEN, IMAGE_SOFT_TOKEN)
#: Pixels per side of the (square) image the vision tower sees.
INTERLEAVED_IMAGE_SIZE = 64
INTERLEAVED_PATCH_SIZE = 8
#: Encoder output rows per image = ``<image_soft_token>`` positions per span (a 4 x 4 pooled grid).
INTERLEAVED_TOKENS_PER_IMAGE = 16
#: Text Gemma3Processor puts on each side of an image span (ordinary text, tokenized with its context).
INTERLEAVED_SPAN_SEPARATOR = "\n\n"
#: Gemma3's tokenizer has runs of one to four newlines as single tokens, and vLLM's Gemma3
#: processor looks them up by their text (a byte-level BPE spells a newline "Ċ", so the shared
#: vocabulary has none of them and vLLM refuses to start). The vLLM-loadable variant adds them as
#: ordinary added tokens after the image tokens (ids 1016..1019); added tokens match longest first,
#: so a run of newlines is one token, as in Gemma3.
NEWLINE_RUN_TOKENS = ("\n", "\n\n", "\n\n\n", "\n\n\n\n")


def _interleaved_token_ids(newline_tokens: bool = False) -> dict[str, int]:
    ids = _added_token_ids()
    ids.update({token: _vocab_size() + index for index, token in enumerate(INTERLEAVED_VL_SPECIAL_TOKENS)})
    if newline_tokens:
        first = _vocab_size() + len(INTERLEAVED_VL_SPECIAL_TOKENS)
        ids.update({token: first + index for index, token in enumerate(NEWLINE_RUN_TOKENS)})
    return ids


def _interleaved_chat_template() -> str:
    # The Qwen3-style conversation format of the other models (so the same stop tokens, reasoning
    # and tool-call parsing apply), with Gemma3's image markup: an image part renders as one
    # <start_of_image>, which the processor then expands.  Gemma3 has no video input.
    image_markup = "{{- '" + _VISION_IMAGE + "' -}}"
    video_markup = "{{- '" + _VISION_VIDEO + "' -}}"
    if CHAT_TEMPLATE.count(image_markup) != 1 or CHAT_TEMPLATE.count(video_markup) != 1:
        raise RuntimeError("CHAT_TEMPLATE changed: cannot derive the interleaved VL template")
    return CHAT_TEMPLATE.replace(image_markup, "{{- '" + IMAGE_BEGIN_TOKEN + "' -}}").replace(
        video_markup, "{{- raise_exception('This model does not accept video input') -}}"
    )


#: Chat template of ``tiny-gemma3``: :data:`CHAT_TEMPLATE` with image parts as ``<start_of_image>``.
INTERLEAVED_VL_CHAT_TEMPLATE = _interleaved_chat_template()


def build_interleaved_vl_tokenizer(out_dir: Path, newline_tokens: bool = False) -> Path:
    """Write the ``tiny-gemma3`` tokenizer: the shared BPE plus Gemma3's three image tokens (and
    with ``newline_tokens`` Gemma3's newline-run tokens, :data:`NEWLINE_RUN_TOKENS`).

    Writes ``tokenizer.json``, ``tokenizer_config.json`` (with Gemma3's named
    ``boi_token`` / ``eoi_token`` / ``image_token`` so ``Gemma3Processor``
    finds them) and ``chat_template.jinja``; returns ``out_dir``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    newlines = NEWLINE_RUN_TOKENS if newline_tokens else ()
    tokenizer = _train_backend_tokenizer(extra_special_tokens=INTERLEAVED_VL_SPECIAL_TOKENS, extra_tokens=newlines)
    _write_text(out_dir / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n")
    config = _tokenizer_config()
    ids = _interleaved_token_ids(newline_tokens)
    for token in INTERLEAVED_VL_SPECIAL_TOKENS + newlines:
        config["added_tokens_decoder"][str(ids[token])] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in INTERLEAVED_VL_SPECIAL_TOKENS,
        }
    config["additional_special_tokens"] = config["additional_special_tokens"] + list(INTERLEAVED_VL_SPECIAL_TOKENS)
    config.update(boi_token=IMAGE_BEGIN_TOKEN, eoi_token=IMAGE_END_TOKEN, image_token=IMAGE_SOFT_TOKEN)
    config["processor_class"] = "Gemma3Processor"
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_text(out_dir / "chat_template.jinja", INTERLEAVED_VL_CHAT_TEMPLATE)
    return out_dir


def _interleaved_image_processor_config() -> dict[str, Any]:
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_pan_and_scan": False,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Gemma3ImageProcessor",
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Gemma3Processor",
        "resample": 2,
        "rescale_factor": 0.00392156862745098,
        "size": {"height": INTERLEAVED_IMAGE_SIZE, "width": INTERLEAVED_IMAGE_SIZE},
    }


def build_interleaved_vl_model(out_dir: Path, vllm_loadable: bool = False) -> Path:
    """Write the tokenizer, a tiny random ``Gemma3ForConditionalGeneration`` and its processor configs.

    ``tiny-gemma3`` is the default. With ``vllm_loadable`` the variant vLLM 0.32 loads: head_dim 64
    (hidden 128, 2 / 1 heads; vLLM's CPU attention refuses 16), Gemma3's newline-run tokens
    (:data:`NEWLINE_RUN_TOKENS`, which vLLM's Gemma3 processor looks up) and the vision tower's
    weights under Gemma3's published names (``vision_tower.vision_model.*``: transformers 5.19 saves
    them without ``vision_model.``, which vLLM cannot map; transformers loads both).
    """
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    out_dir = Path(out_dir)
    build_interleaved_vl_tokenizer(out_dir, newline_tokens=vllm_loadable)
    ids = _interleaved_token_ids(newline_tokens=vllm_loadable)
    head_dim = 64 if vllm_loadable else 16
    wide = head_dim == 64
    text_config = {
        "vocab_size": len(ids) + BPE_VOCAB_SIZE,
        "hidden_size": 128 if wide else 64,
        "intermediate_size": 256 if wide else 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2 if wide else 4,
        "num_key_value_heads": 1 if wide else 2,
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 2048,
        # Gemma3 alternates local (sliding window) and global layers; keep one of each.
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 512,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "initializer_range": INITIALIZER_RANGE,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "attention_dropout": 0.0,
        "bos_token_id": ids[PAD_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
        "tie_word_embeddings": False,
    }
    vision_config = {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_channels": 3,
        "image_size": INTERLEAVED_IMAGE_SIZE,
        "patch_size": INTERLEAVED_PATCH_SIZE,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
        "vision_use_head": False,
    }
    config = Gemma3Config(
        text_config=text_config,
        vision_config=vision_config,
        mm_tokens_per_image=INTERLEAVED_TOKENS_PER_IMAGE,
        boi_token_index=ids[IMAGE_BEGIN_TOKEN],
        eoi_token_index=ids[IMAGE_END_TOKEN],
        image_token_index=ids[IMAGE_SOFT_TOKEN],
        initializer_range=INITIALIZER_RANGE,
        # Real Gemma3 ties them; with random weights a tied head mostly predicts the input token
        # back (greedy output is one token forever), so this toy unties them like the Qwen ones.
        tie_word_embeddings=False,
        dtype="float32",
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    model = _create_model(Gemma3ForConditionalGeneration, config)
    _save_model(model, out_dir)
    if vllm_loadable:
        _prefix_weights(out_dir / "model.safetensors", "vision_tower.", "vision_tower.vision_model.")
    _write_json(out_dir / "preprocessor_config.json", _interleaved_image_processor_config())
    _write_json(
        out_dir / "processor_config.json",
        {"image_seq_length": INTERLEAVED_TOKENS_PER_IMAGE, "processor_class": "Gemma3Processor"},
    )
    return out_dir


_BUILDERS = {TEXT_MODEL: build_text_model, VL_MODEL: build_vl_model, INTERLEAVED_VL_MODEL: build_interleaved_vl_model,
             TEXT_MODEL_D64: functools.partial(build_text_model, head_dim=64),
             VL_MODEL_D64: functools.partial(build_vl_model, head_dim=64),
             SMG_VL_MODEL: functools.partial(build_vl_model, smg_anchor=True),
             LLAMA_MODEL: build_llama_model, LLAMA_MODEL_D64: functools.partial(build_llama_model, head_dim=64),
             QWEN3_MODEL: build_qwen3_model, QWEN2_5_VL_MODEL: build_qwen2_5_vl_model,
             QWEN3_VL_MODEL: build_qwen3_vl_model,
             PADDED_TEXT_MODEL: functools.partial(build_text_model, vocab_rows=PADDED_VOCAB_ROWS),
             BENCH_TEXT_MODEL: functools.partial(build_text_model, head_dim=64, shape=BENCH_TEXT_SHAPE)}


# --------------------------------------------------------------------------- cache


def _default_cache_root() -> Path:
    env = os.environ.get("TITO_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "tito" / "models"


def _is_complete_model(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()


def build_cached(target_name: str, builder: Callable[[Path], Path], is_complete: Callable[[Path], bool],
                 cache_dir: Path | None = None) -> Path:
    """Build into ``<cache_dir>/<target_name>`` once, atomically; return that directory.

    ``cache_dir`` defaults to ``$TITO_CACHE_DIR`` if set, else ``~/.cache/tito/models``. The build
    goes into a temporary directory next to the target that is then moved into place with
    ``os.replace``, so concurrent callers never see a half-written directory; if another process
    wins the race its copy is used.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_root()
    target = root / target_name
    if is_complete(target):
        return target

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        builder(tmp)
        os.chmod(tmp, 0o755)
        if target.exists() and not is_complete(target):
            # A leftover that is not a finished build (not ours: builds only appear via os.replace).
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process moved its finished build into place first.
            if not is_complete(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_model(name: str, cache_dir: Path | None = None) -> Path:
    """Return a directory holding the tiny model ``name`` (``<cache_dir>/<name>-<VERSION>``),
    building it on first use (see ``build_cached``)."""
    try:
        builder = _BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown tiny model {name!r}; expected one of {list(_BUILDERS)}") from None
    return build_cached(f"{name}-{VERSION}", builder, _is_complete_model, cache_dir)


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tito_models.tiny",
        description="Build a tiny deterministic Qwen-style model directory (offline).",
    )
    parser.add_argument("out_dir", type=Path, help="directory to write the model into")
    parser.add_argument("--model", choices=sorted(_BUILDERS), default=TEXT_MODEL, help="model to build")
    args = parser.parse_args(argv)
    path = _BUILDERS[args.model](args.out_dir)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
