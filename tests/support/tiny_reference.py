"""The reference the live tests compare with: transformers' own greedy ``generate()`` on a
tiny catalog model, EOS ignored."""
import torch


def hf_greedy(model_id: str, prompt_ids, n: int, adapter_dir=None) -> list[int]:
    """``adapter_dir``: a LoRA adapter in peft's format, loaded with peft's own
    ``PeftModel.from_pretrained`` on top of the model."""
    from transformers import GenerationConfig

    from raycolo.engine.models import build_tiny_model
    model, _ = build_tiny_model(model_id, 0, "float32")
    model.generation_config.eos_token_id = None
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt_ids)]),
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), generation_config=cfg)
    return out[0, len(prompt_ids):].tolist()
