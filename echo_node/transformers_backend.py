"""transformers generation with behaviour logprobs, for GPU volunteers (CUDA when present, CPU
otherwise); full-parameter updates are applied to the weights in place.

Sampling is plain temperature sampling (no top-k / top-p / penalties), and each token's logprob
is log-softmax(logits / T) of the raw logits that produced it: the distribution sampled from.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from echo_node.full_weights import distinct_weights
from echo_node.llama_backend import Completion


class TransformersBackend:
    name = "transformers"

    def __init__(self, model_path: Path, threads: int = 0):
        if threads:
            torch.set_num_threads(threads)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, dtype=torch.float32)
        self.model = model.to(self.device).eval()
        self.config = model.config
        self.vocab_size = model.config.vocab_size
        self.eos = model.config.eos_token_id
        self.n_ctx = model.config.max_position_embeddings
        self.tokenizer = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
        # Master copy on the CPU: updates apply here bit-exactly, then copy into the model.
        self.master = distinct_weights(self.model)
        self.tokens_generated = 0
        self.seconds_generating = 0.0

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Completion:
        started = time.perf_counter()
        torch.manual_seed(seed)
        ids = torch.tensor([prompt_ids], device=self.device)
        out = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
            min_p=None, repetition_penalty=1.0, max_new_tokens=max_new_tokens, output_logits=True,
            return_dict_in_generate=True, pad_token_id=self.eos,
        )
        tokens = out.sequences[0, len(prompt_ids):].tolist()
        if self.eos in tokens:
            tokens = tokens[: tokens.index(self.eos) + 1]
        logits = torch.stack(out.logits[: len(tokens)])[:, 0].float() / temperature  # (T, V)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens, device=self.device)[:, None])
        self.tokens_generated += len(tokens)
        self.seconds_generating += time.perf_counter() - started
        return Completion(tuple(tokens), tuple(float(x) for x in logprobs[:, 0].cpu()))

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def detokenize(self, ids: tuple[int, ...]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @property
    def throughput(self) -> float:
        return self.tokens_generated / self.seconds_generating if self.seconds_generating else 0.0

    @torch.no_grad()
    def load_weights(self, new: dict[str, np.ndarray]) -> None:
        """Copy updated master tensors into the model (a tied lm_head follows embed_tokens)."""
        params = self.model.state_dict()
        for name, value in new.items():
            params[name].copy_(torch.from_numpy(value))
            self.master[name] = value
