"""LoRA adapters for the tests, written by PEFT itself (the library that trains and saves the
adapters users serve), with random A and B so that the adapter visibly changes the model."""

from pathlib import Path

import torch

ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_lora_adapter(model_dir: Path, out_dir: Path, targets=ALL_LINEARS, rank: int = 8, alpha: int = 16,
                       seed: int = 0, scale: float = 1.0, use_rslora: bool = False):
    """Save a PEFT LoRA adapter for the Qwen3 checkpoint in model_dir into out_dir
    (adapter_config.json, adapter_model.safetensors); returns the PEFT model (transformers,
    fp32, eval mode), the reference its answers are checked against. `scale` multiplies the
    random B matrices (PEFT's kaiming init) to make the adapter's effect larger or smaller."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        init_lora_weights=False, use_rslora=use_rslora, task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    model.save_pretrained(out_dir)
    return model.eval()
