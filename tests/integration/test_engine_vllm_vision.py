"""Images through the vllm backend over real gRPC, side by side with the native backend.

Both backends serve `tiny-qwen2-vl-d64` (Qwen2-VL, head_dim 64: vLLM's CPU attention refuses 16)
and a Qwen2.5-VL of the same text width (built here; windowed vision attention), in float32;
requests come from render's own domain code (chat template, image processor, features
with tensors, HMAC tags), so the features vLLM receives are tito's, never vLLM's own processor's.
Greedy tokens must equal the native backend's and Hugging Face `generate`'s on the same input_ids /
pixel_values / image_grid_thw; for Qwen2.5-VL videos, whose M-RoPE text positions after the video
vLLM and transformers place differently, they must equal vLLM's own `LLM.generate` on the same
frames instead. Gemma3, whose images vLLM's CPU attention computes causally, is refused by the
backend; the Gemma3 test pins why. On CPU this needs the torchvision of the vLLM install
(tito/torchvision_cpu.py); `scripts/test.sh` sets TITO_REQUIRE_VLLM=1, so there nothing skips.
"""

from __future__ import annotations

import functools
import io
import types
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer

from tito.config import ConfigError
from tito.grpc_errors import error_details
from tito.v1 import chat_pb2, engine_pb2, engine_pb2_grpc, multimodal_pb2
from tito_engine.config import EngineConfig
from tito_engine.server import create_server
from tito_engine.vllm.args import build_engine_args
from tito_engine.vllm.backend import VllmEngine
from tito_engine.vllm.inputs import MediaConverter
from tito_models.tiny import VL_MODEL_D64, build_interleaved_vl_model, build_qwen2_5_vl_model, ensure_model
from tito_render.media.features import Signer
from tito_render.renderer import Renderer

from chat_parts import image, text, video
from images import noise_png, solid_png
from renderers import load_renderer
from test_engine_families import hf_vl_greedy
from vl_reference import hf_vl_inputs
from test_engine_multimodal import generate, hf_greedy, render

pytestmark = pytest.mark.vllm

TIMEOUT = 180
KEY, KEY_ID = b"engine-vllm-vision-test-key-0123456789", "k1"
VLLM_ARGS = ("--dtype", "float32", "--enforce-eager")
TENSORS, METADATA = multimodal_pb2.MM_PAYLOAD_TENSORS, multimodal_pb2.MM_PAYLOAD_METADATA


def solid(width: int, height: int, rgb: tuple[int, int, int]) -> chat_pb2.ContentPart:
    return chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=solid_png(width, height, rgb)))


@pytest.fixture(scope="module")
def vl_model(model_cache):
    return ensure_model(VL_MODEL_D64, model_cache)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "hmac.key"
    path.write_bytes(KEY + b"\n")
    return path


@pytest.fixture(scope="module")
def renderer(vl_model) -> Renderer:
    """Render signing its items (both engines know the key): signed hashes may key vLLM's cache."""
    return load_renderer(vl_model, signer=Signer(KEY, KEY_ID))


@pytest.fixture(scope="module")
def hf_model(vl_model):
    return AutoModelForImageTextToText.from_pretrained(vl_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def stubs(module_aio_server, vl_model, key_file):
    common = dict(model=str(vl_model), max_model_len=1024, max_running_sequences=64, hmac_key_file=str(key_file),
                  hmac_key_id=KEY_ID)
    configs = {
        "native": EngineConfig(device="cpu", engine_process=False, kv_blocks=1024, **common),
        "vllm": EngineConfig(backend="vllm", kv_cache_bytes=64 << 20, vllm_args=VLLM_ARGS, **common),
    }
    return {name: engine_pb2_grpc.EngineServiceStub(module_aio_server(lambda config=config: create_server(config))
                                                    .channel()) for name, config in configs.items()}


def image_requests(renderer, count: int) -> list[engine_pb2.GenerateRequest]:
    """Chats with one or two images of different sizes and words (render's features, TENSORS)."""
    words = ["sea", "sky", "stone", "leaf", "wind"]
    requests = []
    for k in range(count):
        prompt = " ".join(words[: 1 + k % 5])
        if k % 3 == 0:
            parts = (text(f"Two {k}:"), image(56, 56 + 28 * (k % 2), seed=10 + k), text("and"),
                     image(84, 56, seed=40 + k), text(prompt))
        else:
            parts = (image(28 * (2 + k % 4), 56, seed=10 + k), text(f"{prompt} {k}"))
        requests.append(render(renderer, *parts, max_tokens=10 + k % 7))
    return requests


def load(stub) -> engine_pb2.GetLoadResponse:
    return stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)


def test_model_info_lists_the_same_media(stubs):
    native, vllm_info = (stubs[name].GetModelInfo(engine_pb2.EngineServiceGetModelInfoRequest(), timeout=TIMEOUT)
                         for name in ("native", "vllm"))
    assert [(m.modality, m.placeholder_token_id) for m in vllm_info.modalities] == \
        [(m.modality, m.placeholder_token_id) for m in native.modalities]
    assert multimodal_pb2.MODALITY_IMAGE in [m.modality for m in vllm_info.modalities]


def test_image_prompts_equal_native_and_hf_alone_and_at_concurrency_32(stubs, renderer, hf_model):
    requests = image_requests(renderer, 32)
    expected = [hf_greedy(hf_model, request) for request in requests]
    assert len({tuple(tokens) for tokens in expected}) > 16  # the images and words matter
    for request, want in list(zip(requests, expected))[:4]:
        assert generate(stubs["vllm"], request) == want
        assert generate(stubs["native"], request) == want
    with ThreadPoolExecutor(32) as pool:
        for name in ("vllm", "native"):
            assert list(pool.map(lambda request, stub=stubs[name]: generate(stub, request), requests)) == expected, name
    assert load(stubs["vllm"]).running_requests == 0


def test_blue_ids_with_red_features_answer_like_red(stubs, renderer, hf_model):
    red = render(renderer, text("What colour is this?"), solid(56, 84, (220, 20, 30)), max_tokens=16)
    blue = render(renderer, text("What colour is this?"), solid(56, 84, (20, 40, 230)), max_tokens=16)
    assert list(red.token_ids) == list(blue.token_ids)  # same size: identical placeholder runs
    want_red, want_blue = hf_greedy(hf_model, red), hf_greedy(hf_model, blue)
    assert want_red != want_blue
    swapped = engine_pb2.GenerateRequest()
    swapped.CopyFrom(blue)
    swapped.mm_features.CopyFrom(red.mm_features)
    for name in ("vllm", "native"):
        assert generate(stubs[name], swapped) == want_red, name
        assert generate(stubs[name], blue) == want_blue, name


def test_metadata_after_tensors_hits_vllms_encoder_cache(stubs, renderer, hf_model):
    parts = (text("Look:"), image(56, 56, seed=606), text("What is it?"))
    with_tensors = render(renderer, *parts, max_tokens=12)
    expected = hf_greedy(hf_model, with_tensors)
    before = load(stubs["vllm"])
    assert generate(stubs["vllm"], with_tensors) == expected
    after_tensors = load(stubs["vllm"])
    assert after_tensors.encoder_cache_misses == before.encoder_cache_misses + 1
    metadata_only = render(renderer, *parts, max_tokens=12, payload=METADATA)
    (item,) = metadata_only.mm_features.items
    assert not item.kwargs and item.metadata and item.auth_tag
    assert generate(stubs["vllm"], metadata_only) == expected
    assert load(stubs["vllm"]).encoder_cache_hits == after_tensors.encoder_cache_hits + 1


def test_metadata_only_item_vllm_never_saw_needs_tensors(stubs, renderer):
    request = render(renderer, text("Look:"), image(56, 56, seed=909), text("What is it?"), max_tokens=4,
                     payload=METADATA)
    with pytest.raises(grpc.RpcError) as raised:
        generate(stubs["vllm"], request)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = error_details(raised.value)
    assert details["reason"] == "MM_TENSORS_REQUIRED"
    assert details["fields"] == ["mm_features.items[0].kwargs"]
    # The same refusal as the native engine's, and the engine serves the next request.
    with pytest.raises(grpc.RpcError) as native:
        generate(stubs["native"], request)
    assert (native.value.code(), error_details(native.value)["reason"]) == (grpc.StatusCode.FAILED_PRECONDITION,
                                                                            "MM_TENSORS_REQUIRED")
    assert generate(stubs["vllm"], render(renderer, text("Look:"), image(56, 56, seed=909), max_tokens=4))


def test_video_and_image_prompt_equals_native_and_hf(stubs, renderer, hf_model):
    frames = chat_pb2.VideoFrames(frames=[chat_pb2.ImageSource(data=noise_png(56, 56, seed=70 + k)) for k in range(4)],
                                  fps=2.0)
    request = render(renderer, text("A clip:"), chat_pb2.ContentPart(video=frames), text("and a still:"),
                     image(56, 84, seed=75), max_tokens=16)
    assert [item.modality for item in request.mm_features.items] == [multimodal_pb2.MODALITY_VIDEO,
                                                                     multimodal_pb2.MODALITY_IMAGE]
    expected = hf_greedy(hf_model, request)
    assert generate(stubs["vllm"], request) == expected
    assert generate(stubs["native"], request) == expected


def test_encode_is_refused_on_the_vllm_backend(stubs, renderer):
    request = render(renderer, text("Look:"), image(56, 56, seed=5))
    with pytest.raises(grpc.RpcError) as raised:
        stubs["vllm"].Encode(engine_pb2.EncodeRequest(mm_features=request.mm_features), timeout=TIMEOUT)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_details(raised.value)["reason"] == "ENCODE_UNSUPPORTED"


# --------------------------------------------------------------------------- Qwen2.5-VL


@pytest.fixture(scope="module")
def qwen2_5_dir(tmp_path_factory):
    return build_qwen2_5_vl_model(tmp_path_factory.mktemp("models") / "tiny-qwen2.5-vl-d64", head_dim=64)


@pytest.fixture(scope="module")
def qwen2_5(module_aio_server, qwen2_5_dir):
    """A tiny Qwen2.5-VL with head_dim 64: its renderer, HF model and both backends' stubs."""
    model_dir = qwen2_5_dir
    common = dict(model=str(model_dir), max_model_len=1024, max_running_sequences=32)
    configs = {
        "native": EngineConfig(device="cpu", engine_process=False, kv_blocks=512, **common),
        "vllm": EngineConfig(backend="vllm", kv_cache_bytes=32 << 20, vllm_args=VLLM_ARGS, **common),
    }
    stubs = {name: engine_pb2_grpc.EngineServiceStub(module_aio_server(lambda config=config: create_server(config))
                                                     .channel()) for name, config in configs.items()}
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    return load_renderer(model_dir), hf, stubs


def test_qwen2_5_vl_images_equal_native_and_hf(qwen2_5):
    renderer, hf, stubs = qwen2_5
    requests = [
        # 140 x 84 pixels: a 10 x 6 patch grid, several of the vision tower's windows.
        render(renderer, text("Describe:"), image(140, 84, seed=1), text("Briefly."), max_tokens=16),
        render(renderer, text("Two:"), image(56, 84, seed=3), text("and"), image(112, 56, seed=4), max_tokens=16),
        render(renderer, text("Words only, no picture."), max_tokens=12),
    ]
    expected = [hf_vl_greedy(hf, request) for request in requests]
    assert all(len(set(tokens)) > 3 for tokens in expected)
    for name in ("vllm", "native"):
        assert [generate(stubs[name], request) for request in requests] == expected, name
    copies = []
    for round_ in range(4):  # each copy its own request id: ids must be unique among live requests
        for request in requests:
            copy = engine_pb2.GenerateRequest()
            copy.CopyFrom(request)
            copy.request_id = f"{request.request_id or 'q25'}-{round_}"
            copies.append(copy)
    with ThreadPoolExecutor(len(copies)) as pool:
        assert list(pool.map(lambda request: generate(stubs["vllm"], request), copies)) == expected * 4


#: (frames, fps) of the Qwen2.5-VL videos: at fps 2 a time step is 1 s, 2 positions
#: (tokens_per_second 2), at fps 0.5 it is 4 s, 8 positions: both reach past the 2 x 2 merged grid.
QWEN2_5_VIDEOS = ((4, 2.0), (6, 0.5), (2, 2.0))


def qwen2_5_video_chat(frames: int, fps: float) -> tuple:
    return text("A clip:"), video(frames, fps, seed=50 + frames), text("What moves?")


def test_qwen2_5_vl_videos_on_the_native_backend_equal_hf(qwen2_5):
    renderer, hf, stubs = qwen2_5
    for frames, fps in QWEN2_5_VIDEOS:
        request = render(renderer, *qwen2_5_video_chat(frames, fps), max_tokens=16)
        assert generate(stubs["native"], request) == hf_vl_greedy(hf, request), (frames, fps)


def test_qwen2_5_vl_positions_after_a_video_are_vllms_own_rule(qwen2_5, qwen2_5_dir):
    """The one place the backends part: vLLM 0.32 starts the text after a video at its largest
    M-RoPE position + 1, transformers 5.19 (and the native engine) at its start + max(h, w) / merge;
    the video's own positions, time axis included, are equal (so tito hands vLLM the video's
    second_per_grid_ts). Fails once vLLM adopts transformers' rule: the tokens then equal HF's too."""
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
    from vllm.multimodal.inputs import MultiModalFeatureSpec

    renderer, hf, _ = qwen2_5
    converter = MediaConverter(_vllm_item_builder(qwen2_5_dir), cache=None)
    vllm_model = types.SimpleNamespace(config=hf.config)
    vllm_model.iter_mm_grid_thw = functools.partial(Qwen2_5_VLForConditionalGeneration.iter_mm_grid_thw, vllm_model)
    for frames, fps in QWEN2_5_VIDEOS:
        request = render(renderer, *qwen2_5_video_chat(frames, fps))
        (item,) = request.mm_features.items
        checked = types.SimpleNamespace(item=item, modality="video", path="mm_features.items[0]", trusted_hash=False)
        (kwargs_item,), _, (placeholder,) = (values["video"] for values in converter.convert([checked])[:3])
        assert float(kwargs_item["second_per_grid_ts"].data) == 2 / fps
        ours, _ = Qwen2_5_VLForConditionalGeneration.get_mrope_input_positions(
            vllm_model, list(request.token_ids),
            [MultiModalFeatureSpec(data=kwargs_item, modality="video", identifier="v", mm_position=placeholder)])
        inputs = hf_vl_inputs(request, video_seconds=True)
        theirs = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                         video_grid_thw=inputs["video_grid_thw"],
                                         second_per_grid_ts=inputs["second_per_grid_ts"])[0][:, 0]
        end = item.placeholder.offset + item.placeholder.length
        assert torch.equal(ours[:, :end], theirs[:, :end]), (frames, fps)
        _, h, w = (int(x) for x in inputs["video_grid_thw"][0])
        start = int(theirs[1, item.placeholder.offset])
        last_time = int(theirs[0, end - 1])
        assert theirs[:, end].tolist() == [start + max(h, w) // 2] * 3
        assert ours[:, end].tolist() == [max(last_time, start + max(h, w) // 2 - 1) + 1] * 3


def _vllm_item_builder(model_dir):
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    processor = MULTIMODAL_REGISTRY.create_processor(ModelConfig(model=str(model_dir), dtype="float32"))
    return MediaConverter.item_builder(processor)


@pytest.fixture(scope="module")
def qwen2_5_vllm_itself(qwen2_5_dir):
    """vLLM's own LLM on the Qwen2.5-VL, fed raw frames through its own processor (no tito code)."""
    from vllm import LLM

    llm = LLM(model=str(qwen2_5_dir), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=32 << 20,
              max_model_len=1024, max_num_seqs=8, generation_config="vllm", limit_mm_per_prompt={"video": 1})
    yield llm
    llm.llm_engine.engine_core.shutdown()


def vllm_own_greedy(llm, hf_tokenizer, frames: int, fps: float, max_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) of vLLM's own LLM for the chat of `qwen2_5_video_chat`."""
    from vllm import SamplingParams

    messages = [{"role": "user", "content": [{"type": "text", "text": "A clip:"}, {"type": "video"},
                                             {"type": "text", "text": "What moves?"}]}]
    prompt = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pixels = np.stack([np.asarray(Image.open(io.BytesIO(noise_png(56, 56, seed=50 + frames + k))).convert("RGB"))
                       for k in range(frames)])
    metadata = {"fps": fps, "total_num_frames": frames, "frames_indices": list(range(frames)),
                "duration": frames / fps, "width": 56, "height": 56, "do_sample_frames": False}
    (output,) = llm.generate({"prompt": prompt, "multi_modal_data": {"video": [(pixels, metadata)]}},
                             SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False),
                             use_tqdm=False)
    return list(output.prompt_token_ids), list(output.outputs[0].token_ids)


def test_qwen2_5_vl_videos_through_vllm_equal_vllms_own_processing(qwen2_5, qwen2_5_vllm_itself):
    """`--backend vllm` on render's video features answers as vLLM does when it decodes and
    processes the same frames at the same fps itself: same prompt ids, same greedy tokens, alone
    and together."""
    renderer, hf, stubs = qwen2_5
    tokenizer = AutoTokenizer.from_pretrained(hf.name_or_path)
    requests, expected = [], []
    for frames, fps in QWEN2_5_VIDEOS:
        request = render(renderer, *qwen2_5_video_chat(frames, fps), max_tokens=16)
        prompt_ids, tokens = vllm_own_greedy(qwen2_5_vllm_itself, tokenizer, frames, fps, 16)
        assert prompt_ids == list(request.token_ids), (frames, fps)
        if frames == 2:  # one time step: both position rules agree, and so do vLLM and HF
            assert tokens == hf_vl_greedy(hf, request)
        requests.append(request)
        expected.append(tokens)
    assert [generate(stubs["vllm"], request) for request in requests] == expected
    with ThreadPoolExecutor(len(requests)) as pool:
        assert list(pool.map(lambda request: generate(stubs["vllm"], request), requests)) == expected



def stored_media_keys(stub, mm_hash: str, deadline: float = 60.0) -> list[tuple[int, list[int]]]:
    """(block size, media offsets) of every stored block the engine's KV events say holds the item
    `mm_hash`, reading its event log from the start until the first such block arrives."""
    found: list[tuple[int, list[int]]] = []
    stream = stub.SubscribeKvEvents(engine_pb2.SubscribeKvEventsRequest(start_sequence=0), timeout=deadline)
    try:
        for batch in stream:
            for event in batch.events:
                if event.WhichOneof("event") != "block_stored":
                    continue
                stored = event.block_stored
                for keys in stored.extra_keys:
                    offsets = [media.offset for media in keys.media if media.mm_hash == mm_hash]
                    if offsets:
                        found.append((stored.block_size, offsets))
            if found:
                return found
    finally:
        stream.cancel()
    return found


def test_kv_events_of_both_backends_key_an_image_block_by_its_mm_hash(stubs, renderer):
    """A block that holds part of an image is published with the item's mm_hash (vLLM's own
    events, relayed by tito's backend, as the native engine's): a router can tell two images
    apart whose placeholder token ids are equal."""
    request = render(renderer, image(56, 56, seed=77), text(" ".join(["the long quiet harbour"] * 90)),
                     max_tokens=2)
    mm_hash = request.mm_features.items[0].mm_hash
    for name in ("native", "vllm"):
        generate(stubs[name], request)
        found = stored_media_keys(stubs[name], mm_hash)
        assert found, f"{name}: no stored block carries the image's mm_hash"
        block_size, offsets = found[0]
        start = request.mm_features.items[0].placeholder.offset
        # The first block that holds the image says where in it the image starts (vLLM's offset).
        assert offsets[0] == start % block_size, (name, start, found)


# --------------------------------------------------------------------------- Gemma3


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return build_interleaved_vl_model(tmp_path_factory.mktemp("models") / "tiny-gemma3-vllm", vllm_loadable=True)


def test_vllms_cpu_build_computes_gemma3_images_causally_so_the_backend_refuses_it(gemma3_dir):
    """Why `--backend vllm` refuses Gemma3 on CPU (vllm/args.py check_attention): vLLM's own LLM
    loads the vLLM-loadable tiny Gemma3 and processes the image as HF does (same prompt ids), but
    answers as HF does with the image's bidirectional attention taken away (no token_type_ids),
    not as the model does. Fails once vLLM's CPU attention implements the mask: then the backend
    starts, and its tokens belong beside the native engine's here."""
    from vllm import LLM, SamplingParams
    from transformers import AutoProcessor

    prompt = "<|im_start|>user\nLook: <start_of_image> what is it?<|im_end|>\n<|im_start|>assistant\n"
    picture = Image.open(io.BytesIO(noise_png(64, 64, seed=3))).convert("RGB")
    inputs = AutoProcessor.from_pretrained(gemma3_dir)(text=prompt, images=[picture], return_tensors="pt")
    hf = AutoModelForImageTextToText.from_pretrained(gemma3_dir, dtype=torch.float32).eval()

    def hf_generate(**kwargs) -> list[int]:
        with torch.inference_mode():
            output = hf.generate(**kwargs, do_sample=False, max_new_tokens=8)
        return output[0, inputs["input_ids"].shape[1]:].tolist()

    bidirectional = hf_generate(**inputs)
    causal = hf_generate(**{name: value for name, value in inputs.items() if name != "token_type_ids"})
    assert bidirectional != causal
    llm = LLM(model=str(gemma3_dir), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=32 << 20,
              max_model_len=1024, max_num_seqs=4, generation_config="vllm", limit_mm_per_prompt={"image": 1})
    try:
        (output,) = llm.generate({"prompt": prompt, "multi_modal_data": {"image": picture}},
                                 SamplingParams(temperature=0.0, max_tokens=8, detokenize=False), use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert list(output.prompt_token_ids) == inputs["input_ids"][0].tolist()
    assert list(output.outputs[0].token_ids) == causal
    with pytest.raises(ConfigError, match=r"image tokens attend to one another in both directions \(gemma3\)"):
        VllmEngine(build_engine_args(EngineConfig(backend="vllm", model=str(gemma3_dir), kv_cache_bytes=32 << 20),
                                     str(gemma3_dir)), gemma3_dir, model_id=str(gemma3_dir))
