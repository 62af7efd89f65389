"""transformers' greedy generate on a rendered GenerateRequest of a Qwen2-VL-style model: the
pixel values and grids of its media items, and `mm_token_type_ids` (1 at image, 2 at video
placeholders) without which M-RoPE gives other tokens."""

from __future__ import annotations

import torch

from tito import tensors
from tito.v1 import engine_pb2, multimodal_pb2


def hf_vl_inputs(request: engine_pb2.GenerateRequest, features=None, video_seconds: bool = False) -> dict:
    """generate's inputs for the request's ids with `features`' tensors (default: its own), as a
    Qwen2-VL-style processor returns them; `video_seconds`: videos' second_per_grid_ts too
    (Qwen2.5-VL's time axis)."""
    features = request.mm_features if features is None else features
    ids = torch.tensor([list(request.token_ids)])
    types = torch.zeros_like(ids)
    inputs: dict = {}
    for modality, type_id, pixel_key, grid_key in ((multimodal_pb2.MODALITY_IMAGE, 1, "pixel_values", "image_grid_thw"),
                                                   (multimodal_pb2.MODALITY_VIDEO, 2, "pixel_values_videos",
                                                    "video_grid_thw")):
        items = [item for item in features.items if item.modality == modality]
        if not items:
            continue
        for item in items:  # exactly the is_embed positions (a Qwen3-VL video span's timestamps are text)
            mask = list(item.placeholder.is_embed) or [True] * item.placeholder.length
            for k, on in enumerate(mask):
                types[0, item.placeholder.offset + k] = type_id if on else 0
        inputs[pixel_key] = torch.cat([tensors.to_torch(item.kwargs[pixel_key]) for item in items])
        inputs[grid_key] = torch.cat([tensors.to_torch(item.metadata[grid_key]).reshape(-1, 3) for item in items])
        if video_seconds and modality == multimodal_pb2.MODALITY_VIDEO:
            inputs["second_per_grid_ts"] = torch.cat([tensors.to_torch(item.metadata["second_per_grid_ts"])
                                                      for item in items])
    return dict(inputs, input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types)


def hf_vl_greedy(model, request: engine_pb2.GenerateRequest, features=None, video_seconds: bool = False) -> list[int]:
    """HF generate on `hf_vl_inputs`: greedy, for `max_tokens`; `model` a Qwen2-VL-style model
    (or a PeftModel over one)."""
    inputs = hf_vl_inputs(request, features, video_seconds)
    with torch.inference_mode():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=request.sampling_params.max_tokens)
    return output[0, inputs["input_ids"].shape[1]:].tolist()
