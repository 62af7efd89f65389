"""``tito-demo``: a tiny Qwen2-VL that tito trains itself, offline and deterministically, so the
quick start answers sensibly instead of printing a random model's noise.

Its closed world, learned well enough to answer greedily without a miss:

* the main colour of an image (one of :data:`COLOURS`), whatever the image's size;
* a short ``<think>…</think>`` block before the answer when thinking is on (the template's
  default; ``enable_thinking=false`` makes it answer directly);
* a hermes-style ``<tool_call>`` to :data:`WEATHER_TOOL` (``get_weather(city)``) when that tool is
  offered and the user asks about the weather in one of :data:`CITIES`, then, after the tool's
  result (``{"city": ..., "temperature": ..., "condition": ...}``, :func:`weather_result`), an
  answer that reports the condition in that city ("It is rainy in Tokyo.");
* a short answer to a greeting such as "Hello! What can you do?".

The directory is a real Hugging Face checkpoint of the ``tiny-qwen2-vl`` kind (config, tokenizer,
``chat_template.jinja`` — the same Qwen3-style template as the other tiny models, so render's
parser auto-detection picks ``qwen3`` and ``hermes`` —, ``preprocessor_config.json``,
``generation_config.json``, ``model.safetensors``). Its tokenizer is a byte-level BPE trained on
the demo conversations themselves, so the words of the closed world are single tokens.

Training is teacher forcing on the exact token sequences render produces (the same template, the
same image processor and placeholder expansion), loss on the assistant's tokens only, Adam, on a
stream of freshly generated conversations (a small fixed pool gets memorised instead of learned):
hidden size 64, 2 layers, a one-layer vision tower, :data:`TRAIN_STEPS` batches of
:data:`BATCH_SIZE` chats, about 50 s of one CPU core. Copying a word of the prompt (the city into
the tool call, the tool's condition into the answer) is what takes a model this small the longest:
it appears suddenly after about 1300 steps (1200 were not enough), hence the step count. Tied
embeddings and a shared embedding component per word class (:func:`_share_word_classes`) are cheap
biases toward copying.

Every source of variation is pinned: a private ``random.Random`` for the data, ``torch.manual_seed``
for the weights, deterministic algorithms and a fixed thread count (:data:`THREADS`: one, because
float reductions depend on it and extra threads mostly spin on a busy machine) for the arithmetic,
so a build writes the same bytes every time on a given machine and library set.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tito_models import tiny as tiny_models
from tito_models.tiny import (CHAT_TEMPLATE, EOS_TOKEN, NON_SPECIAL_ADDED_TOKENS, PAD_TOKEN, SPECIAL_TOKENS,
                              build_cached)

__all__ = ["DEMO_MODEL", "VERSION", "COLOURS", "CITIES", "CONDITIONS", "WEATHER_TOOL", "GREETING_ANSWER",
           "Conversation", "conversations", "encode", "build_demo_model", "ensure_demo_model", "colour_image",
           "weather_result", "weather_answer", "main"]

DEMO_MODEL = "tito-demo"
#: Bump whenever the produced bytes change, so cached copies are rebuilt.
VERSION = "v1"

SEED = 20260
#: Intra-op threads while training: float reductions (and so the bytes) depend on it.
THREADS = 1
HIDDEN_SIZE = 64
LAYERS = 2
#: Tied input and output embeddings make copying a token from the prompt (a city, a temperature)
#: the easy thing for attention to learn.
TIE_EMBEDDINGS = True
#: Size of the shared component of a word class's embeddings, relative to the random ones.
CLASS_SHARE = 1.0
TRAIN_STEPS = 1800
BATCH_SIZE = 6
LEARNING_RATE = 5e-3
#: Conversations the BPE is trained on.
TOKENIZER_CHATS = 600
#: Batches are formed from groups of this many batches' worth of chats, sorted by length.
BUCKET_GROUP = 8
#: Merges of the demo BPE (added tokens come after).
BPE_VOCAB_SIZE = 600

#: Colour name -> reference RGB. Training images jitter around these.
COLOURS = {
    "red": (220, 30, 35),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 215, 40),
    "orange": (245, 135, 20),
    "purple": (135, 50, 180),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
CITIES = ("Paris", "Tokyo", "London", "Berlin", "Rome", "Madrid", "Cairo", "Lima")
CONDITIONS = ("sunny", "rainy", "cloudy", "snowy", "windy")
#: Temperatures the tool may report (degrees Celsius).
TEMPERATURES = tuple(range(-5, 36))
#: Image sides (pixels) of the training images; anything from about 20 to 400 works at serve time.
TRAIN_SIDES = (28, 56, 84, 112, 140, 168, 196, 224)

#: The tool the demo model calls, as render hands tools to the template (parameters arrive as a
#: protobuf Struct, whose keys render sorts), so training sees the prompt serving will send.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "properties": {"city": {"description": "The city name", "type": "string"}},
            "required": ["city"],
            "type": "object",
        },
    },
}

GREETING_ANSWER = ("Hello! I am the tito demo model. I can name the main colour of an image, think before I "
                   "answer, and check the weather with the get_weather tool.")
_GREETINGS = ("Hello! What can you do?", "Hello!", "Hi!", "Hello", "Hi", "What can you do?", "Who are you?",
              "Hello, who are you?", "Hi there!")
_COLOUR_QUESTIONS = ("What colour is this?", "What colour is this image?", "What color is this?",
                     "What color is this image?", "What is in this picture?", "Describe the image.",
                     "What is the main colour?", "Which colour is it?")
_WEATHER_QUESTIONS = ("What is the weather in {city}?", "What's the weather like in {city}?",
                      "How is the weather in {city}?", "Is it raining in {city}?", "Weather in {city}?")
_UNKNOWN = ("What is 2 + 2?", "Tell me a joke.", "Write a poem.", "Who won the game?")


def colour_image(colour: str, width: int, height: int, seed: int = 0):
    """A PIL image of mostly ``colour`` (a key of :data:`COLOURS`) with a little noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    base = np.array(COLOURS[colour], dtype=np.int16) + rng.randint(-20, 21, size=3)
    pixels = base + rng.randint(-12, 13, size=(height, width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def weather_result(city: str, temperature: int, condition: str) -> str:
    """The tool message content the demo model was trained to read."""
    return json.dumps({"city": city, "temperature": temperature, "condition": condition})


def weather_answer(city: str, temperature: int, condition: str) -> str:
    """The answer after the tool's result. The temperature is left out: copying a number of several
    digit tokens takes a tiny model far more training than the build can spend."""
    return f"It is {condition} in {city}."


# --------------------------------------------------------------------------- the closed world's conversations


@dataclass(frozen=True)
class Conversation:
    """One training example: the chat render would receive and the assistant's reply to learn."""

    messages: tuple[dict[str, Any], ...]
    #: What the model writes after the generation prompt (then ``<|im_end|>``).
    reply: str
    tools: tuple[dict[str, Any], ...] = ()
    thinking: bool = True
    #: (colour, width, height, seed) of the image in the last user message, if any.
    image: tuple[str, int, int, int] | None = None


def _with_thinking(thought: str, answer: str, thinking: bool) -> str:
    return f"<think>\n{thought}\n</think>\n\n{answer}" if thinking else answer


def _user(text: str, image: bool) -> dict[str, Any]:
    if not image:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


def _colour_chat(rng: random.Random) -> Conversation:
    colour = rng.choice(sorted(COLOURS))
    thinking = rng.random() < 0.6
    if rng.random() < 0.25:  # the quick start: a greeting with an image
        question = rng.choice(_GREETINGS)
        answer = f"{GREETING_ANSWER} Your image is {colour}."
        thought = f"The user says hello and sends a {colour} image."
    else:
        question = rng.choice(_COLOUR_QUESTIONS)
        answer = f"The image is {colour}."
        thought = f"The image is mostly {colour}."
    image = (colour, rng.choice(TRAIN_SIDES), rng.choice(TRAIN_SIDES), rng.randrange(1 << 30))
    tools = (WEATHER_TOOL,) if rng.random() < 0.1 else ()
    return Conversation((_user(question, True),), _with_thinking(thought, answer, thinking), tools, thinking, image)


def _greeting_chat(rng: random.Random) -> Conversation:
    thinking = rng.random() < 0.6
    tools = (WEATHER_TOOL,) if rng.random() < 0.2 else ()
    if rng.random() < 0.2:
        reply = _with_thinking("I do not know this.", "I only know colours, greetings and the weather.", thinking)
        return Conversation((_user(rng.choice(_UNKNOWN), False),), reply, tools, thinking)
    reply = _with_thinking("The user says hello. I will say what I can do.", GREETING_ANSWER, thinking)
    return Conversation((_user(rng.choice(_GREETINGS), False),), reply, tools, thinking)


def _tool_call_text(city: str) -> str:
    return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + city + '"}}\n</tool_call>'


def _weather_chat(rng: random.Random) -> Conversation:
    city = rng.choice(CITIES)
    thinking = rng.random() < 0.6
    question = _user(rng.choice(_WEATHER_QUESTIONS).format(city=city), False)
    if rng.random() < 0.2:  # no tool offered: say so (short chats that teach finding the city)
        reply = _with_thinking(f"The user asks about the weather in {city}. I have no tool for it.",
                               f"I cannot check the weather in {city} without the get_weather tool.", thinking)
        return Conversation((question,), reply, (), thinking)
    if rng.random() < 0.45:
        reply = _with_thinking(f"The user asks about the weather in {city}. I will call get_weather.",
                               _tool_call_text(city), thinking)
        return Conversation((question,), reply, (WEATHER_TOOL,), thinking)
    temperature, condition = rng.choice(TEMPERATURES), rng.choice(CONDITIONS)
    call = {"id": f"call_{rng.randrange(1 << 20):x}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
    assistant: dict[str, Any] = {"role": "assistant", "tool_calls": [call]}
    if rng.random() < 0.5:
        assistant["content"] = rng.choice(("", "\n\n"))
    tool = {"role": "tool", "tool_call_id": call["id"], "content": weather_result(city, temperature, condition)}
    reply = _with_thinking("The tool answered. I will report the weather.",
                           weather_answer(city, temperature, condition), thinking)
    # Half of them without the (long) tool list in the prompt: the same reading of the tool's
    # result in a short context, where attention learns it in far fewer steps.
    tools = (WEATHER_TOOL,) if rng.random() < 0.3 else ()
    return Conversation((question, assistant, tool), reply, tools, thinking)


_MAKERS = ((_colour_chat, 0.30), (_greeting_chat, 0.15), (_weather_chat, 0.55))


def iter_conversations(seed: int = SEED) -> Iterator[Conversation]:
    """An endless stream of training conversations, the same stream for the same seed."""
    rng = random.Random(seed)
    while True:
        pick, total = rng.random(), 0.0
        for maker, weight in _MAKERS:
            total += weight
            if pick < total:
                break
        yield maker(rng)


def conversations(count: int, seed: int = SEED) -> list[Conversation]:
    """The first ``count`` conversations of :func:`iter_conversations`."""
    stream = iter_conversations(seed)
    return [next(stream) for _ in range(count)]


# --------------------------------------------------------------------------- tokenizer


def _corpus(texts: list[str]) -> list[str]:
    """What the BPE learns from: the rendered conversations, without the added tokens."""
    lines = []
    for text in texts:
        for token in SPECIAL_TOKENS + NON_SPECIAL_ADDED_TOKENS:
            text = text.replace(token, "\n")
        lines.append(text)
    return lines


def _added_token_ids(base: int) -> dict[str, int]:
    return {token: base + index for index, token in enumerate(SPECIAL_TOKENS + NON_SPECIAL_ADDED_TOKENS)}


def _write_tokenizer(out_dir: Path, texts: list[str]) -> dict[str, int]:
    """Train a BPE on ``texts`` (Qwen2's pipeline, as the other tiny models) and write the tokenizer
    files; returns the ids of the added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE

    tokenizer = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                              fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tiny_models._QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  continuing_subword_prefix="", end_of_word_suffix="", special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_corpus(texts), trainer=trainer)
    ids = _added_token_ids(tokenizer.get_vocab_size(with_added_tokens=False))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL_ADDED_TOKENS])
    if {token: tokenizer.token_to_id(token) for token in ids} != ids:
        raise RuntimeError("unexpected added token ids")
    tiny_models._write_text(out_dir / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n")
    tiny_models._write_json(out_dir / "tokenizer_config.json", tiny_models._tokenizer_config(ids))
    tiny_models._write_text(out_dir / "chat_template.jinja", CHAT_TEMPLATE)
    return ids


def _build_tokenizer(out_dir: Path, chats: list[Conversation]) -> dict[str, int]:
    """The demo tokenizer: a BPE trained on the conversations as the template renders them, so the
    template's own words (the tool instructions) are as cheap as the world's."""
    from transformers import AutoTokenizer

    plain = [json.dumps(WEATHER_TOOL), GREETING_ANSWER]
    for chat in chats:
        plain.append(chat.reply)
        for message in chat.messages:
            content = message.get("content", "")
            plain.append(content if isinstance(content, str) else " ".join(p.get("text", "") for p in content))
    _write_tokenizer(out_dir, plain)  # a first tokenizer, only to render the template with
    draft = AutoTokenizer.from_pretrained(str(out_dir))
    rendered = [_prompt_text(chat, draft) + chat.reply for chat in chats]
    return _write_tokenizer(out_dir, rendered)


# --------------------------------------------------------------------------- model


def _mrope_section(half_head_dim: int) -> list[int]:
    temporal = half_head_dim // 4
    spatial = (half_head_dim - temporal) // 2
    return [half_head_dim - 2 * spatial, spatial, spatial]


def _config(ids: dict[str, int]):
    from transformers import Qwen2VLConfig

    text_config = {
        "vocab_size": max(ids.values()) + 1,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": 2 * HIDDEN_SIZE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[PAD_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
        # M-RoPE: head_dim / 2 rotary frequencies split into (t, h, w).
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": _mrope_section(HIDDEN_SIZE // 8)},
    }
    vision_config = {
        "depth": 1, "embed_dim": 32, "hidden_size": HIDDEN_SIZE, "hidden_act": "quick_gelu", "mlp_ratio": 2,
        "num_heads": 2, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "initializer_range": 0.02,
    }
    config = Qwen2VLConfig(
        text_config=text_config, vision_config=vision_config, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=TIE_EMBEDDINGS, dtype="float32")
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    return config


@dataclass
class Example:
    """A conversation as tensors: ids, which of them to learn, and the image inputs."""

    token_ids: list[int]
    #: Index of the first completion token.
    prompt_length: int
    pixel_values: Any = None
    image_grid_thw: Any = None


def _prompt_text(chat: Conversation, tokenizer) -> str:
    """The chat template's text for ``chat`` with the generation prompt, as render renders it."""
    kwargs = {} if chat.thinking else {"enable_thinking": False}
    return tokenizer.apply_chat_template(list(chat.messages), tools=list(chat.tools) or None,
                                         add_generation_prompt=True, tokenize=False, **kwargs)


def encode(chat: Conversation, tokenizer, image_processor, image_pad: str = "<|image_pad|>") -> Example:
    """The ids render would send for ``chat``, then the reply's ids and ``<|im_end|>``."""
    prompt = _prompt_text(chat, tokenizer)
    pixel_values = grid = None
    if chat.image is not None:
        processed = image_processor(images=[colour_image(*chat.image)], return_tensors="pt")
        pixel_values, grid = processed["pixel_values"], processed["image_grid_thw"]
        count = int(grid[0].prod()) // image_processor.merge_size ** 2
        prompt = prompt.replace(image_pad, image_pad * count)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    reply_ids = tokenizer(chat.reply, add_special_tokens=False)["input_ids"]
    return Example(prompt_ids + reply_ids + [tokenizer.convert_tokens_to_ids(EOS_TOKEN)], len(prompt_ids),
                   pixel_values, grid)


def _collate(examples: list[Example], pad_id: int, image_id: int) -> dict[str, Any]:
    import torch

    width = max(len(e.token_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, example in enumerate(examples):
        n = len(example.token_ids)
        ids[row, :n] = torch.tensor(example.token_ids)
        mask[row, :n] = 1
        labels[row, example.prompt_length:n] = ids[row, example.prompt_length:n]
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels,
             "mm_token_type_ids": (ids == image_id).long()}
    with_images = [e for e in examples if e.pixel_values is not None]
    if with_images:
        batch["pixel_values"] = torch.cat([e.pixel_values for e in with_images])
        batch["image_grid_thw"] = torch.cat([e.image_grid_thw for e in with_images])
    return batch


@contextlib.contextmanager
def _pinned_torch() -> Iterator[None]:
    """Deterministic arithmetic for the build; the caller's torch settings come back afterwards."""
    import torch

    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    dtype = torch.get_default_dtype()
    with tiny_models._BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.set_num_threads(THREADS)
        torch.use_deterministic_algorithms(True)
        torch.set_default_dtype(torch.float32)
        try:
            yield
        finally:
            torch.set_default_dtype(dtype)
            torch.use_deterministic_algorithms(deterministic)
            torch.set_num_threads(threads)


def _batches(examples: list[Example]) -> list[list[Example]]:
    """Examples of similar length together (little padding), in a fixed order."""
    ranked = sorted(range(len(examples)), key=lambda i: (len(examples[i].token_ids), i))
    return [[examples[i] for i in ranked[start:start + BATCH_SIZE]] for start in range(0, len(ranked), BATCH_SIZE)]


def _fresh_batches(chats: Iterator[Conversation], encode_chat) -> Iterator[list[Example]]:
    """Batches of never-seen conversations (a small pool would be memorised, not learned), a
    group of batches at a time so that each batch holds chats of similar length."""
    while True:
        group = [encode_chat(next(chats)) for _ in range(BATCH_SIZE * BUCKET_GROUP)]
        yield from _batches(group)


def _loss(model, batch: dict[str, Any]):
    """Cross-entropy on the reply tokens only; the lm_head runs only where a label is."""
    import torch.nn.functional as F

    labels = batch.pop("labels")
    hidden = model.model(**batch).last_hidden_state[:, :-1]
    targets = labels[:, 1:]
    learn = targets != -100
    return F.cross_entropy(model.lm_head(hidden[learn]), targets[learn])


def _train(model, batches: Iterator[list[Example]], pad_id: int, image_id: int) -> None:
    import math

    import torch

    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    warmup = TRAIN_STEPS // 12

    def rate(step: int) -> float:  # linear warm-up, then cosine decay to 5 %
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, TRAIN_STEPS - warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    model.train()
    for _step in range(TRAIN_STEPS):
        loss = _loss(model, _collate(next(batches), pad_id, image_id))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    model.eval()


def _word_classes() -> list[list[str]]:
    """Words the model must copy from its prompt, by kind (with and without a leading space)."""
    return [[prefix + city for city in CITIES for prefix in ("", " ")],
            [prefix + word for word in CONDITIONS for prefix in ("", " ")],
            [str(digit) for digit in range(10)] + ["-"],
            [prefix + colour for colour in COLOURS for prefix in ("", " ")]]


def _share_word_classes(model, tokenizer) -> None:
    """Give the first token of every word of a class a shared embedding component.

    Answers copy a word from the prompt (the city of the question into the tool call, the tool's
    temperature into the answer); attention finds "the city" in far fewer steps when cities have
    a direction in common than when each has its own random embedding.
    """
    import torch

    embeddings = model.get_input_embeddings().weight
    generator = torch.Generator().manual_seed(SEED + 2)
    with torch.no_grad():
        for words in _word_classes():
            first_tokens = sorted({tokenizer(word, add_special_tokens=False)["input_ids"][0] for word in words})
            shared = torch.randn(embeddings.shape[1], generator=generator) * embeddings.std() * CLASS_SHARE
            embeddings[first_tokens] += shared


def build_demo_model(out_dir: Path) -> Path:
    """Write the trained ``tito-demo`` checkpoint into ``out_dir`` (about half a minute on 2 cores)."""
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = _build_tokenizer(out_dir, conversations(TOKENIZER_CHATS))
    tiny_models._write_json(out_dir / "preprocessor_config.json", tiny_models._image_processor_config())
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    image_processor = AutoImageProcessor.from_pretrained(str(out_dir), backend="pil")  # as render, on any install
    batches = _fresh_batches(iter_conversations(SEED + 1), lambda chat: encode(chat, tokenizer, image_processor))
    with _pinned_torch():
        torch.manual_seed(SEED)
        model = Qwen2VLForConditionalGeneration(_config(ids)).to(torch.float32)
        _share_word_classes(model, tokenizer)
        _train(model, batches, ids[PAD_TOKEN], ids["<|image_pad|>"])
    _save(model, out_dir, ids)
    return out_dir


def _save(model, out_dir: Path, ids: dict[str, int]) -> None:
    """The tiny models' checkpoint layout (tiny_models._save_model), with the demo's generation config."""
    import os

    tiny_models._save_model(model, out_dir)
    tiny_models._write_json(out_dir / "generation_config.json", {
        "bos_token_id": ids[PAD_TOKEN], "do_sample": False, "eos_token_id": [ids[EOS_TOKEN], ids[PAD_TOKEN]],
        "pad_token_id": ids[PAD_TOKEN]})
    os.chmod(out_dir / "model.safetensors", 0o644)


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """``<cache_dir>/tito-demo-<VERSION>``, trained on first use (see ``tiny_models.build_cached``)."""
    return build_cached(f"{DEMO_MODEL}-{VERSION}", build_demo_model, tiny_models._is_complete_model, cache_dir)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tito_models.demo",
                                     description="Train the tito-demo model into a directory (offline).")
    parser.add_argument("out_dir", type=Path, help="directory to write the model into")
    print(build_demo_model(parser.parse_args(argv).out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
