"""PEFT LoRA adapters the tests make themselves, and HF + PEFT generation as the reference.

PEFT initialises lora_B to zeros (a fresh adapter changes nothing); these adapters draw every
lora_A and lora_B from a seeded generator instead, at a scale that moves the tiny models' greedy
tokens, so an adapter the engine failed to apply (or applied to the wrong rows) shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class AdapterSpec:
    """One test adapter: its name, rank, alpha, targets, seed, and PEFT's use_rslora."""

    name: str
    rank: int
    targets: tuple[str, ...]
    seed: int
    alpha: int = 16
    rslora: bool = False


#: Three adapters of different ranks and targets (attention only, MLP only, everything with rslora).
ADAPTERS = (
    AdapterSpec("attn-r8", 8, ("q_proj", "v_proj"), seed=1),
    AdapterSpec("mlp-r16", 16, ("gate_proj", "up_proj", "down_proj"), seed=2, alpha=32),
    AdapterSpec("all-r16", 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                seed=3, rslora=True),
)


def make_adapter(model_dir: Path, spec: AdapterSpec, out_dir: Path, scale: float = 0.3) -> Path:
    """Write `spec` as PEFT's save_pretrained does, for the base model in `model_dir` (a
    vision-language model's adapter targets its language model's modules)."""
    from peft import LoraConfig, get_peft_model

    base = load_base(model_dir)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0,
                        use_rslora=spec.rslora, task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    model.save_pretrained(out_dir)
    return out_dir


def write_adapter(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    """An adapter directory written by hand (a config and tensors as given, checked by nobody):
    for the refusals, and for models PEFT's causal-LM classes do not load. Returns its name."""
    import json

    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory.name


def q_proj_adapter(hidden: int, rank: int = 4, layer: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    """The config and tensors of a rank-`rank` adapter of one layer's q_proj ([hidden, hidden])."""
    key = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"]}
    tensors = {key.format(layer, "A"): torch.zeros(rank, hidden), key.format(layer, "B"): torch.zeros(hidden, rank)}
    return config, tensors


def load_base(model_dir: Path):
    """The base model in `model_dir`: a causal LM, or a vision-language model whole (float32)."""
    import json

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = json.loads((Path(model_dir) / "config.json").read_text())
    if "vision_config" in config:
        return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(model_dir)


class PeftReference:
    """HF + PEFT's greedy `generate` over one base model with several adapters loaded (PEFT's own
    adapter switching), and with adapters disabled for the base model."""

    def __init__(self, model_dir: Path, adapters: dict[str, Path]):
        from peft import PeftModel

        base = load_base(model_dir).eval()
        (first, first_dir), *rest = adapters.items()
        self.model = PeftModel.from_pretrained(base, first_dir, adapter_name=first).eval()
        for name, directory in rest:
            self.model.load_adapter(directory, adapter_name=name)

    def generate(self, adapter: str | None, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy tokens under `adapter` (None: the base model)."""
        return self._under(adapter, lambda: self._generate(prompt, max_new_tokens))

    def generate_rendered(self, adapter: str | None, request) -> list[int]:
        """Greedy tokens under `adapter` for a rendered GenerateRequest with media items (a
        Qwen2-VL-style base: vl_reference.hf_vl_greedy)."""
        from vl_reference import hf_vl_greedy

        return self._under(adapter, lambda: hf_vl_greedy(self.model, request))

    def _under(self, adapter: str | None, run):
        if adapter is None:
            with self.model.disable_adapter():
                return run()
        self.model.set_adapter(adapter)
        return run()

    def _generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            output = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                         do_sample=False)
        return output[0, len(prompt):].tolist()
