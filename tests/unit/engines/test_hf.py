"""engines.hf: a GGUF loads through its cached checkpoint exactly as transformers loads the file."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engines.hf import gguf_checkpoint, load_model, load_tokenizer, prompt_ids

TEXT = "What is 2 + 4? <|im_end|> Ünïcode\n\n  spaces"


def test_a_gguf_loads_through_its_cache_as_transformers_loads_the_file(tiny_model, echo_cache):
    path = tiny_model
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    direct = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=torch.float32)
    direct_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)

    model, tokenizer = load_model(path, dtype=torch.float32), load_tokenizer(path)
    cached = gguf_checkpoint(path)
    assert cached.parent == echo_cache / "hf" and (cached / "model.safetensors").exists()
    ours, theirs = model.state_dict(), direct.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert tokenizer(TEXT).input_ids == direct_tokenizer(TEXT).input_ids
    assert tokenizer.eos_token_id == direct_tokenizer.eos_token_id
    messages = (("user", "What is 2 + 4?"),)
    assert prompt_ids(tokenizer, messages) == prompt_ids(direct_tokenizer, messages)

    # A second load uses the cache as it is.
    stamp = (cached / "model.safetensors").stat().st_mtime_ns
    assert gguf_checkpoint(path) == cached and (cached / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_peft_model_takes_its_cache_as_its_base_model_does(tiny_model):
    """peft's forward takes **kwargs: the keyword is read from the base model's, so a LoRA model
    generates with `cache` where transformers renamed it (the old name warns, then goes in 5.40)."""
    import inspect

    from peft import LoraConfig, get_peft_model

    from engines.hf import cache_field

    base = load_model(tiny_model, dtype=torch.float32)
    expected = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    lora = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
    assert cache_field(lora) == cache_field(base) == expected
