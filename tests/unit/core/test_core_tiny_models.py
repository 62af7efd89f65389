"""Tests for tito_models.tiny: deterministic offline tiny Qwen2 / Qwen2-VL / Gemma3 builds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tito_models import tiny as tiny_models  # noqa: E402
from tito_models.tiny import (  # noqa: E402
    INTERLEAVED_VL_MODEL,
    TEXT_MODEL,
    TEXT_MODEL_D64,
    VL_MODEL,
    VL_MODEL_D64,
    build_interleaved_vl_model,
    build_text_model,
    build_tokenizer,
    build_vl_model,
    ensure_model,
)

from interleaved_spans import expand_image_placeholders, find_image_spans, interleaved_image_span  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]

EXPECTED_IDS = {
    "<|endoftext|>": 1000,
    "<|im_start|>": 1001,
    "<|im_end|>": 1002,
    "<|vision_start|>": 1003,
    "<|vision_end|>": 1004,
    "<|image_pad|>": 1005,
    "<|video_pad|>": 1006,
    "<tool_call>": 1007,
    "</tool_call>": 1008,
    "<tool_response>": 1009,
    "</tool_response>": 1010,
    "<think>": 1011,
    "</think>": 1012,
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def build_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def text_dir(build_root) -> Path:
    return build_text_model(build_root / "text")


@pytest.fixture(scope="session")
def vl_dir(build_root) -> Path:
    return build_vl_model(build_root / "vl")


@pytest.fixture(scope="session")
def tokenizer(text_dir):
    return transformers.AutoTokenizer.from_pretrained(text_dir)


@pytest.fixture(scope="session")
def vl_model(vl_dir):
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(vl_dir)
    return model.eval()


def _dir_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


# --------------------------------------------------------------------------- determinism


def test_rebuild_is_byte_identical(build_root, text_dir, vl_dir):
    again_text = build_text_model(build_root / "text-again")
    again_vl = build_vl_model(build_root / "vl-again")
    assert _dir_bytes(again_text) == _dir_bytes(text_dir)
    assert _dir_bytes(again_vl) == _dir_bytes(vl_dir)
    assert set(_dir_bytes(text_dir)) == {
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert set(_dir_bytes(vl_dir)) == set(_dir_bytes(text_dir)) | {"preprocessor_config.json"}


def test_cli_in_fresh_process_matches(build_root, text_dir):
    # A fresh interpreter has different hash seeds (Python and Rust), so this also
    # checks that tokenizer training does not depend on them.
    out = build_root / "cli-text"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    env["PYTHONHASHSEED"] = "12345"
    proc = subprocess.run(
        [sys.executable, "-m", "tito_models.tiny", str(out), "--model", TEXT_MODEL],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    assert _dir_bytes(out) == _dir_bytes(text_dir)


def test_build_tokenizer_only(build_root, text_dir):
    out = build_tokenizer(build_root / "tok-only")
    files = _dir_bytes(out)
    assert set(files) == {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    reference = _dir_bytes(text_dir)
    for name, data in files.items():
        assert data == reference[name]


def test_json_files_are_sorted(text_dir, vl_dir):
    for path in [*text_dir.glob("*config.json"), vl_dir / "preprocessor_config.json", vl_dir / "config.json"]:
        text = path.read_text(encoding="utf-8")
        assert text == json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n", path


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_loads_with_expected_special_tokens(tokenizer, text_dir):
    assert type(tokenizer).__name__ in {"Qwen2Tokenizer", "Qwen2TokenizerFast", "PreTrainedTokenizerFast"}
    assert len(tokenizer) == 1013
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == EXPECTED_IDS["<|im_end|>"]
    assert tokenizer.pad_token_id == EXPECTED_IDS["<|endoftext|>"]
    for token, token_id in EXPECTED_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id], token
        # Also inside running text.
        ids = tokenizer.encode(f"a{token}b", add_special_tokens=False)
        assert token_id in ids
    special = set(tokenizer.all_special_tokens)
    assert {t for t in EXPECTED_IDS if t.startswith("<|")} <= special
    assert not {"<think>", "</think>", "<tool_call>"} & special
    config = json.loads((text_dir / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer)


def test_tokenizer_matches_raw_tokenizers_and_round_trips(tokenizer, text_dir):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(text_dir / "tokenizer.json"))
    samples = [
        "Hello, world! The café serves crème brûlée.",
        "日本語のテキスト 😀🚀 — «quotes» and numbers 12345.678",
        'def f(x):\n    return {"a": [1, 2, 3]}\n',
        "<|im_start|>user\nhi<|im_end|>\n<think>\nok\n</think>\n\n<tool_call>{}</tool_call>",
        "unseen words: zyxwvut qqq ÆØÅ ß 🦙",
    ]
    for text in samples:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == raw.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids) == text
    # Byte-level BPE: every id decodes, and the vocabulary is really ~1000 tokens.
    assert raw.get_vocab_size(with_added_tokens=False) == 1000
    # BPE merges really happened: common words are single tokens, text is shorter than its bytes.
    assert len(tokenizer.encode(" the", add_special_tokens=False)) == 1
    sentence = "The quick brown fox jumps over the lazy dog."
    assert len(tokenizer.encode(sentence, add_special_tokens=False)) < len(sentence.encode()) // 2


def test_skip_special_tokens_keeps_think_and_tool_tags(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\n<think>x</think><tool_call>y</tool_call><|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<think>x</think><tool_call>y</tool_call>"


# --------------------------------------------------------------------------- chat template


def test_chat_template_file_is_used(tokenizer, text_dir):
    assert (text_dir / "chat_template.jinja").read_text(encoding="utf-8") == tokenizer.chat_template
    assert "chat_template" not in json.loads((text_dir / "tokenizer_config.json").read_text())


def test_chat_template_basic_and_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert _render(tokenizer, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    )
    assert _render(tokenizer, messages, add_generation_prompt=True).endswith(
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert _render(tokenizer, messages, add_generation_prompt=True, enable_thinking=True).endswith(
        "<|im_start|>assistant\n"
    )
    assert _render(tokenizer, messages, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_chat_template_tools_tool_calls_and_results(tokenizer):
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should call the tool twice.",
            "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Tokyo"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c0", "content": '{"temp": 22}'},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 18}'},
    ]
    text = _render(tokenizer, messages, tools=TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are helpful.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' in text
    assert (
        "<|im_start|>assistant\n<think>\nI should call the tool twice.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        # string arguments are rendered verbatim
        '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Tokyo"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert (
        "<|im_start|>user\n<tool_response>\n{\"temp\": 22}\n</tool_response>\n"
        "<tool_response>\n{\"temp\": 18}\n</tool_response><|im_end|>\n"
    ) in text
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")

    # content=None (dropped by transformers) with a tool call, no reasoning, thinking off.
    messages[2] = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}],
    }
    text = _render(tokenizer, messages[:4], tools=TOOLS, add_generation_prompt=True, enable_thinking=False)
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}' in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")

    ids = tokenizer.apply_chat_template(messages[:4], tools=TOOLS, add_generation_prompt=True, return_dict=False)
    for token in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert EXPECTED_IDS[token] in ids


def test_chat_template_reasoning_history(tokenizer):
    # reasoning of the final turn is rendered; that of turns before the last user query is dropped (Qwen3).
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
    ]
    assert _render(tokenizer, messages) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n4<|im_end|>\n"
    )
    messages.append({"role": "user", "content": "And 3+3?"})
    text = _render(tokenizer, messages, add_generation_prompt=True)
    assert "Add them." not in text
    assert "<|im_start|>assistant\n4<|im_end|>\n" in text
    # <think> inline in content is split out like reasoning_content.
    inline = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nyes"}]
    assert _render(tokenizer, inline).endswith("<|im_start|>assistant\n<think>\nhmm\n</think>\n\nyes<|im_end|>\n")


def test_chat_template_multimodal_parts(tokenizer):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look: "},
                {"type": "image"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "video"},
                {"type": "text", "text": " What is it?"},
            ],
        }
    ]
    text = _render(tokenizer, messages, add_generation_prompt=True)
    assert text == (
        "<|im_start|>user\nLook: "
        "<|vision_start|><|image_pad|><|vision_end|>"
        "<|vision_start|><|image_pad|><|vision_end|>"
        "<|vision_start|><|video_pad|><|vision_end|>"
        " What is it?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids.count(EXPECTED_IDS["<|image_pad|>"]) == 2
    assert ids.count(EXPECTED_IDS["<|video_pad|>"]) == 1
    assert ids.count(EXPECTED_IDS["<|vision_start|>"]) == 3


def test_chat_template_rejects_unknown_role(tokenizer):
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="narrator"):
        _render(tokenizer, [{"role": "narrator", "content": "Once upon a time"}])


# --------------------------------------------------------------------------- text model


def test_text_model_config_and_varied_greedy_generation(text_dir, tokenizer):
    model = transformers.AutoModelForCausalLM.from_pretrained(text_dir).eval()
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.dtype == torch.float32
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    assert (cfg.intermediate_size, cfg.max_position_embeddings, cfg.vocab_size) == (128, 2048, len(tokenizer))
    assert cfg.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    gen = transformers.GenerationConfig.from_pretrained(text_dir)
    assert gen.eos_token_id == [EXPECTED_IDS["<|im_end|>"], EXPECTED_IDS["<|endoftext|>"]]

    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story about a fox."}], add_generation_prompt=True, return_tensors="pt"
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False, min_new_tokens=20)
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(new) == 20
    assert len(set(new)) > 5, new
    with torch.no_grad():
        again = model.generate(**inputs, max_new_tokens=20, do_sample=False, min_new_tokens=20)
    assert torch.equal(out, again)


# --------------------------------------------------------------------------- VL model


def _image():
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, size=(48, 64, 3), dtype=np.uint8))  # 64 wide, 48 high


def test_vl_config_matches_tokenizer(vl_model, vl_dir):
    tok = transformers.AutoTokenizer.from_pretrained(vl_dir)
    cfg = vl_model.config
    assert type(vl_model).__name__ == "Qwen2VLForConditionalGeneration"
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>") == EXPECTED_IDS["<|image_pad|>"]
    assert cfg.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    text_cfg, vision_cfg = cfg.text_config, cfg.vision_config
    assert text_cfg.vocab_size == len(tok)
    assert text_cfg.hidden_size == vision_cfg.hidden_size == 64
    head_dim = text_cfg.hidden_size // text_cfg.num_attention_heads
    assert sum(text_cfg.rope_parameters["mrope_section"]) == head_dim // 2
    assert (vision_cfg.embed_dim, vision_cfg.num_heads, vision_cfg.patch_size) == (32, 2, 14)
    assert (vision_cfg.spatial_merge_size, vision_cfg.temporal_patch_size) == (2, 2)


def test_vl_image_processor(vl_dir):
    processor = transformers.AutoImageProcessor.from_pretrained(vl_dir)
    out = processor(images=[_image()], return_tensors="pt")
    assert set(out) >= {"pixel_values", "image_grid_thw"}
    grid = out["image_grid_thw"]
    assert grid.shape == (1, 3)
    assert grid[0, 0].item() == 1
    patches = int(grid.prod())
    assert out["pixel_values"].shape == (patches, 3 * 2 * 14 * 14)
    assert patches // 4 <= 64  # max_pixels keeps images tiny


def test_vl_forward_with_one_image(vl_model, vl_dir):
    tok = transformers.AutoTokenizer.from_pretrained(vl_dir)
    processor = transformers.AutoImageProcessor.from_pretrained(vl_dir)
    image_inputs = processor(images=[_image()], return_tensors="pt")
    grid = image_inputs["image_grid_thw"]
    n_image_tokens = int(grid.prod()) // vl_model.config.vision_config.spatial_merge_size**2

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = text.replace("<|image_pad|>", "<|image_pad|>" * n_image_tokens)
    enc = tok(text, return_tensors="pt")
    input_ids = enc["input_ids"]
    mm_token_type_ids = (input_ids == vl_model.config.image_token_id).to(torch.int32)
    assert int(mm_token_type_ids.sum()) == n_image_tokens

    with torch.no_grad():
        # transformers 5.x refuses image inputs without mm_token_type_ids (needed for M-RoPE).
        with pytest.raises(ValueError, match="mm_token_type_ids"):
            vl_model(**enc, pixel_values=image_inputs["pixel_values"], image_grid_thw=grid)
        out = vl_model(
            **enc,
            pixel_values=image_inputs["pixel_values"],
            image_grid_thw=grid,
            mm_token_type_ids=mm_token_type_ids,
        )
    assert out.logits.shape == (1, input_ids.shape[1], vl_model.config.text_config.vocab_size)
    assert torch.isfinite(out.logits).all()


# --------------------------------------------------------------------------- ensure_model


def test_ensure_model_builds_once(tmp_path, text_dir):
    first = ensure_model(TEXT_MODEL, cache_dir=tmp_path)
    assert first == tmp_path / f"{TEXT_MODEL}-{tiny_models.VERSION}"
    assert _dir_bytes(first) == _dir_bytes(text_dir)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_model(TEXT_MODEL, cache_dir=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp dirs left behind


def test_ensure_model_uses_env_cache_dir(tmp_path, monkeypatch, text_dir):
    monkeypatch.setenv("TITO_CACHE_DIR", str(tmp_path / "env-cache"))
    path = ensure_model(TEXT_MODEL)
    assert path == tmp_path / "env-cache" / f"{TEXT_MODEL}-{tiny_models.VERSION}"
    assert (path / "config.json").is_file()


def test_ensure_model_concurrent_callers(tmp_path, text_dir):
    results, errors = [], []

    def worker():
        try:
            results.append(ensure_model(TEXT_MODEL, cache_dir=tmp_path))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(set(results)) == 1
    assert _dir_bytes(results[0]) == _dir_bytes(text_dir)
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]


def test_ensure_model_rejects_unknown_name(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model"):
        ensure_model("gpt-5", cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())


def test_ensure_model_vl_registered():
    assert tiny_models.MODELS == (TEXT_MODEL, VL_MODEL, INTERLEAVED_VL_MODEL, TEXT_MODEL_D64, VL_MODEL_D64,
                                  tiny_models.LLAMA_MODEL, tiny_models.QWEN3_MODEL, tiny_models.QWEN2_5_VL_MODEL,
                                  tiny_models.QWEN3_VL_MODEL, tiny_models.PADDED_TEXT_MODEL,
                                  tiny_models.BENCH_TEXT_MODEL, tiny_models.SMG_VL_MODEL, tiny_models.LLAMA_MODEL_D64)
    assert tiny_models.MODELS == ("tiny-qwen2", "tiny-qwen2-vl", "tiny-gemma3", "tiny-qwen2-d64", "tiny-qwen2-vl-d64",
                                  "tiny-llama", "tiny-qwen3", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen2-padded",
                                  "tiny-qwen2-h256", "tiny-qwen2-vl-smg", "tiny-llama-d64")


@pytest.mark.parametrize("name,architecture,model_type", [
    ("tiny-qwen2-h256", "Qwen2ForCausalLM", "qwen2"),
    ("tiny-llama", "LlamaForCausalLM", "llama"),
    ("tiny-llama-d64", "LlamaForCausalLM", "llama"),
    ("tiny-qwen3", "Qwen3ForCausalLM", "qwen3"),
    ("tiny-qwen2.5-vl", "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl"),
    ("tiny-qwen3-vl", "Qwen3VLForConditionalGeneration", "qwen3_vl"),
])
def test_more_families_build_deterministically_with_the_shared_tokenizer(build_root, text_dir, name, architecture,
                                                                         model_type):
    first = tiny_models.main([str(build_root / f"{name}-1"), "--model", name]) or build_root / f"{name}-1"
    again = tiny_models._BUILDERS[name](build_root / f"{name}-2")
    assert _dir_bytes(first) == _dir_bytes(again)
    files = _dir_bytes(first)
    for shared in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert files[shared] == _dir_bytes(text_dir)[shared]
    config = json.loads(files["config.json"])
    assert config["architectures"] == [architecture] and config["model_type"] == model_type
    assert config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings")) is False
    if name == "tiny-qwen2-h256":
        assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
                config["num_key_value_heads"], config["intermediate_size"]) == (256, 4, 4, 2, 1024)
    if name.startswith("tiny-llama"):
        assert config["rope_parameters"]["rope_type"] == "llama3"
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        assert head_dim == (64 if name == "tiny-llama-d64" else 16)  # vLLM's CPU attention needs 64
    if name == "tiny-qwen3":
        assert config["head_dim"] == 32 != config["hidden_size"] // config["num_attention_heads"]
    if name == "tiny-qwen2.5-vl":
        assert config["vision_config"]["fullatt_block_indexes"] == [1] and config["vision_config"]["window_size"] == 56
        assert json.loads(files["preprocessor_config.json"])["image_processor_type"] == "Qwen2VLImageProcessor"
    if name == "tiny-qwen3-vl":
        text, vision = config["text_config"], config["vision_config"]
        assert text["head_dim"] == 64 and text["rope_parameters"]["mrope_interleaved"] is True
        assert sum(text["rope_parameters"]["mrope_section"]) == text["head_dim"] // 2
        assert vision["deepstack_visual_indexes"] == [0, 1] and vision["patch_size"] == 16
        assert json.loads(files["video_preprocessor_config.json"])["video_processor_type"] == "Qwen3VLVideoProcessor"


def test_ensure_model_builds_interleaved_vl(tmp_path, gemma_dir):
    path = ensure_model(INTERLEAVED_VL_MODEL, cache_dir=tmp_path)
    assert path == tmp_path / f"{INTERLEAVED_VL_MODEL}-{tiny_models.VERSION}"
    assert _dir_bytes(path) == _dir_bytes(gemma_dir)


# --------------------------------------------------------------------------- interleaved-span VL model (Gemma3)

GEMMA3_IDS = {"<start_of_image>": 1013, "<end_of_image>": 1014, "<image_soft_token>": 1015}
TOKENS_PER_IMAGE = 16


@pytest.fixture(scope="session")
def gemma_dir(build_root) -> Path:
    return build_interleaved_vl_model(build_root / "gemma3")


@pytest.fixture(scope="session")
def gemma_tokenizer(gemma_dir):
    return transformers.AutoTokenizer.from_pretrained(gemma_dir)


@pytest.fixture(scope="session")
def gemma_model(gemma_dir):
    return transformers.AutoModelForImageTextToText.from_pretrained(gemma_dir).eval()


def _image_messages(*parts):
    return [{"role": "user", "content": list(parts)}]


def _gemma_inputs(tokenizer, image_processor, images, text_before="Look: ", text_after=" What is it?"):
    parts = [{"type": "text", "text": text_before}]
    parts += [{"type": "image"} for _ in images]
    parts.append({"type": "text", "text": text_after})
    prompt = _render(tokenizer, _image_messages(*parts), add_generation_prompt=True)
    expanded = expand_image_placeholders(prompt)
    enc = tokenizer(expanded, return_tensors="pt")
    image_inputs = image_processor(images=images, return_tensors="pt")
    return prompt, enc, image_inputs


def test_interleaved_rebuild_is_byte_identical(build_root, gemma_dir, text_dir):
    again = build_interleaved_vl_model(build_root / "gemma3-again")
    assert _dir_bytes(again) == _dir_bytes(gemma_dir)
    assert set(_dir_bytes(gemma_dir)) == set(_dir_bytes(text_dir)) | {
        "preprocessor_config.json",
        "processor_config.json",
    }
    for name in ("preprocessor_config.json", "processor_config.json", "config.json", "tokenizer_config.json"):
        text = (gemma_dir / name).read_text(encoding="utf-8")
        assert text == json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n", name


def test_interleaved_tokenizer_extends_the_shared_one(gemma_tokenizer, tokenizer):
    assert len(gemma_tokenizer) == len(tokenizer) + 3 == 1016
    for token, token_id in {**EXPECTED_IDS, **GEMMA3_IDS}.items():
        assert gemma_tokenizer.convert_tokens_to_ids(token) == token_id
        assert gemma_tokenizer.encode(f"x{token}y", add_special_tokens=False)[1] == token_id
    # Gemma3Processor reads these named tokens from the tokenizer.
    assert (gemma_tokenizer.boi_token, gemma_tokenizer.boi_token_id) == ("<start_of_image>", 1013)
    assert (gemma_tokenizer.eoi_token, gemma_tokenizer.image_token_id) == ("<end_of_image>", 1015)
    assert set(GEMMA3_IDS) <= set(gemma_tokenizer.all_special_tokens)
    text = "The café serves 日本語 😀 <think>x</think>\n\n"
    assert gemma_tokenizer.encode(text) == tokenizer.encode(text)
    span_text = expand_image_placeholders("<start_of_image>")
    assert gemma_tokenizer.decode(gemma_tokenizer.encode(span_text), skip_special_tokens=True) == "\n\n\n\n"


def test_interleaved_chat_template(gemma_tokenizer, tokenizer, gemma_dir):
    assert (gemma_dir / "chat_template.jinja").read_text(encoding="utf-8") == tiny_models.INTERLEAVED_VL_CHAT_TEMPLATE
    messages = _image_messages(
        {"type": "text", "text": "Compare "}, {"type": "image"}, {"type": "text", "text": " and "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    )
    assert _render(gemma_tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>user\nCompare <start_of_image> and <start_of_image><|im_end|>\n<|im_start|>assistant\n"
    )
    # Text-only conversations (with tools) render exactly as with the shared template.
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert _render(gemma_tokenizer, chat, tools=TOOLS, add_generation_prompt=True) == _render(
        tokenizer, chat, tools=TOOLS, add_generation_prompt=True
    )
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="video"):
        _render(gemma_tokenizer, _image_messages({"type": "video"}))


def test_interleaved_image_processor_loads_pil_backend(gemma_dir):
    # The PIL backend is what render asks for (transformers picks torchvision's where installed).
    processor = transformers.AutoImageProcessor.from_pretrained(gemma_dir, backend="pil")
    assert type(processor).__name__ == "Gemma3ImageProcessorPil"
    out = processor(images=[_image(), _image().resize((20, 90))], return_tensors="pt")
    assert out["pixel_values"].shape == (2, 3, 64, 64)
    assert out["num_crops"].tolist() == [0, 0]
    assert out["pixel_values"].dtype == torch.float32
    assert -1.0 <= float(out["pixel_values"].min()) and float(out["pixel_values"].max()) <= 1.0


def test_the_vllm_loadable_interleaved_variant(build_root, gemma_dir, gemma_tokenizer):
    """head_dim 64, Gemma3's newline-run tokens (one token per run of 1 to 4, as vLLM's Gemma3
    processor expects) and the vision weights under Gemma3's published names; tiny-gemma3's
    first 1016 ids unchanged, and transformers loads the renamed weights as the model's own."""
    from safetensors import safe_open

    variant = build_interleaved_vl_model(build_root / "gemma3-vllm", vllm_loadable=True)
    assert _dir_bytes(build_interleaved_vl_model(build_root / "gemma3-vllm-again", vllm_loadable=True)) == \
        _dir_bytes(variant)
    tokenizer = transformers.AutoTokenizer.from_pretrained(variant)
    vocab = tokenizer.get_vocab()
    assert [vocab["\n" * n] for n in (1, 2, 3, 4)] == [1016, 1017, 1018, 1019]
    assert {token: vocab[token] for token in gemma_tokenizer.get_vocab()} == gemma_tokenizer.get_vocab()
    ids = tokenizer.encode("a\n\n\nb\n\n\n\n\n\nc", add_special_tokens=False)
    assert ids[1] == 1018 and ids[3:5] == [1019, 1017] and tokenizer.decode(ids) == "a\n\n\nb\n\n\n\n\n\nc"
    config = json.loads((variant / "config.json").read_text())["text_config"]
    assert (config["head_dim"], config["vocab_size"]) == (64, 1020)
    with safe_open(variant / "model.safetensors", "pt") as weights:
        vision = [name for name in weights.keys() if name.startswith("vision_tower.")]
    assert vision and all(name.startswith("vision_tower.vision_model.") for name in vision)
    model = transformers.AutoModelForImageTextToText.from_pretrained(variant, dtype=torch.float32)
    with safe_open(variant / "model.safetensors", "pt") as weights:
        stored = weights.get_tensor("vision_tower.vision_model.embeddings.patch_embedding.weight")
    assert torch.equal(model.model.vision_tower.embeddings.patch_embedding.weight, stored)


def test_interleaved_image_span_layout():
    span = interleaved_image_span()
    assert span.tokens == ("<start_of_image>",) + ("<image_soft_token>",) * 16 + ("<end_of_image>",)
    assert span.token_ids == (1013,) + (1015,) * 16 + (1014,)
    assert span.is_embed == (False,) + (True,) * 16 + (False,)
    assert (len(span), span.num_embeds) == (18, 16)
    # Other ids / sizes, e.g. a real Gemma3 (256 soft tokens, its own ids).
    real = interleaved_image_span(
        tokens_per_image=256,
        token_ids={"<start_of_image>": 255999, "<end_of_image>": 256000, "<image_soft_token>": 262144},
    )
    assert real.token_ids[0] == 255999 and real.token_ids[-1] == 256000 and real.num_embeds == 256
    with pytest.raises(ValueError, match="pan-and-scan"):
        interleaved_image_span({"num_crops": [0, 2]}, image_index=1)
    with pytest.raises(ValueError, match="out of range"):
        interleaved_image_span({"num_crops": [0]}, image_index=1)
    assert interleaved_image_span({"num_crops": torch.tensor([0, 0])}, image_index=1) == span


def test_find_image_spans_and_its_errors():
    span = list(interleaved_image_span().token_ids)
    ids = [5, 6] + span + [7] + span + [8]
    assert find_image_spans(ids) == [(2, 18), (21, 18)]
    assert find_image_spans([1, 2, 3]) == []
    with pytest.raises(ValueError, match="not closed"):
        find_image_spans([1013, 1015])
    with pytest.raises(ValueError, match="not closed before"):
        find_image_spans([1013, 1013, 1014])
    with pytest.raises(ValueError, match="closes no span"):
        find_image_spans([1014])
    with pytest.raises(ValueError, match="outside"):
        find_image_spans([1015])


def test_interleaved_expansion_matches_gemma3_processor(gemma_dir, gemma_tokenizer):
    # The real HF processor loads here (Gemma3 has no torchvision-only video processor): the
    # module's pure expansion must give exactly its ids, and is_embed must be its token_type_ids.
    hf_processor = transformers.AutoProcessor.from_pretrained(gemma_dir)
    assert type(hf_processor).__name__ == "Gemma3Processor"
    image_processor = transformers.AutoImageProcessor.from_pretrained(gemma_dir)
    images = [_image(), _image().rotate(90)]
    for before, after in [("Look: ", " What is it?"), ("", ""), ("a\n", "\n\nb")]:
        prompt, enc, image_inputs = _gemma_inputs(gemma_tokenizer, image_processor, images, before, after)
        reference = hf_processor(text=[prompt], images=[images], return_tensors="pt")
        ids = enc["input_ids"][0].tolist()
        assert ids == reference["input_ids"][0].tolist()
        assert torch.equal(image_inputs["pixel_values"], reference["pixel_values"])

        spans = find_image_spans(ids)
        assert len(spans) == len(images)
        is_embed = [0] * len(ids)
        for index, (offset, length) in enumerate(spans):
            span = interleaved_image_span(image_inputs, index)
            assert length == len(span)
            assert tuple(ids[offset : offset + length]) == span.token_ids
            for position, embed in enumerate(span.is_embed):
                is_embed[offset + position] = int(embed)
        assert is_embed == reference["token_type_ids"][0].tolist()


def test_interleaved_forward_image_tokens_equal_encoder_rows(gemma_model, gemma_dir, gemma_tokenizer):
    cfg = gemma_model.config
    assert type(gemma_model).__name__ == "Gemma3ForConditionalGeneration"
    assert (cfg.boi_token_id, cfg.eoi_token_id, cfg.image_token_id) == (1013, 1014, 1015)
    assert cfg.text_config.vocab_size == len(gemma_tokenizer)
    assert cfg.mm_tokens_per_image == TOKENS_PER_IMAGE
    image_processor = transformers.AutoImageProcessor.from_pretrained(gemma_dir)

    _, enc, image_inputs = _gemma_inputs(gemma_tokenizer, image_processor, [_image()])
    input_ids = enc["input_ids"]
    (offset, length), = find_image_spans(input_ids[0].tolist())
    span = interleaved_image_span(image_inputs, 0)
    is_embed = torch.zeros_like(input_ids)
    is_embed[0, offset : offset + length] = torch.tensor(span.is_embed)
    with torch.no_grad():
        rows = gemma_model.model.get_image_features(image_inputs["pixel_values"]).pooler_output
        assert rows.shape == (1, span.num_embeds, cfg.text_config.hidden_size)
        assert int((input_ids == cfg.image_token_id).sum()) == span.num_embeds == TOKENS_PER_IMAGE
        logits = gemma_model(**enc, pixel_values=image_inputs["pixel_values"], token_type_ids=is_embed).logits
        assert logits.shape == (1, input_ids.shape[1], len(gemma_tokenizer))
        assert torch.isfinite(logits).all()
        # The image reaches the output: another image changes the next-token logits.
        other = image_processor(images=[_image().rotate(90)], return_tensors="pt")["pixel_values"]
        other_logits = gemma_model(**enc, pixel_values=other, token_type_ids=is_embed).logits
        assert not torch.allclose(logits[0, -1], other_logits[0, -1])
        # token_type_ids (bidirectional attention inside an image) matters: an engine must send it.
        causal_logits = gemma_model(**enc, pixel_values=image_inputs["pixel_values"]).logits
        assert not torch.allclose(logits[0, -1], causal_logits[0, -1])
        # A count mismatch between soft tokens and encoder rows is refused.
        with pytest.raises(ValueError, match="do not match"):
            gemma_model(input_ids=input_ids[:, : offset + 5], pixel_values=image_inputs["pixel_values"])
        out = gemma_model.generate(
            **enc, pixel_values=image_inputs["pixel_values"], token_type_ids=is_embed,
            max_new_tokens=20, min_new_tokens=20, do_sample=False,
        )
    new = out[0, input_ids.shape[1] :].tolist()
    assert len(set(new)) > 5, new
