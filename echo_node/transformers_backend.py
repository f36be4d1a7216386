"""transformers generation with behaviour logprobs, for GPU volunteers (CUDA when present, CPU
otherwise); full-parameter updates are applied to the weights in place.

Sampling is the same verifiable Gumbel-max as the llama.cpp backend (`protocols.sampling`), in a
plain KV-cached decoding loop; each token's logprob is log-softmax(logits / T) of the raw logits
that produced it: the distribution sampled from.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from echo_node.full_weights import distinct_weights
from echo_node.gguf_io import load_model, load_tokenizer
from echo_node.llama_backend import Completion
from protocols import sampling


class TransformersBackend:
    name = "transformers"

    def __init__(self, model_path: Path, threads: int = 0):
        if threads:
            torch.set_num_threads(threads)
        model = load_model(model_path, dtype=torch.float32)
        self._use(model, load_tokenizer(model_path))
        # Master copy on the CPU: updates apply here bit-exactly, then copy into the model.
        self.master = distinct_weights(self.model)

    @classmethod
    def of_model(cls, model, tokenizer) -> TransformersBackend:
        """Generate with a model already in memory (the trainer's, for `echo-coordinator eval`)."""
        backend = cls.__new__(cls)
        backend._use(model, tokenizer)
        return backend

    def _use(self, model, tokenizer) -> None:
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = model.to(self.device).eval()
        from echo_node.llama_backend import hardware_summary

        self.hardware = hardware_summary(False, 0, 0, torch.get_num_threads())
        if self.device == "cuda":
            self.hardware = self.hardware.replace("CPU only", f"CUDA {torch.cuda.get_device_name()}")
        self.config = model.config
        self.vocab_size = model.config.vocab_size
        self.eos = model.config.eos_token_id
        self.n_ctx = model.config.max_position_embeddings
        self.tokenizer = tokenizer
        self.tokens_generated = 0
        self.seconds_generating = 0.0

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int | None,
                 offset: int = 0) -> Completion:
        started = time.perf_counter()
        tokens: list[int] = []
        logprobs: list[float] = []
        step = torch.tensor([prompt_ids], device=self.device)
        cache = None
        while len(tokens) < max_new_tokens:
            out = self.model(input_ids=step, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            row = out.logits[0, -1].double().cpu().numpy() / temperature  # (V,)
            token = sampling.choose(row, sampling.noise(seed, [offset + len(tokens)], len(row))[0])
            tokens.append(token)
            logprobs.append(float(sampling.log_softmax(row)[token]))
            if token == self.eos:
                break
            step = torch.tensor([[token]], device=self.device)
        self.tokens_generated += len(tokens)
        self.seconds_generating += time.perf_counter() - started
        return Completion(tuple(tokens), tuple(logprobs))

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
