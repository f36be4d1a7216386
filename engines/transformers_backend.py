"""transformers generation with behaviour logprobs (`engines.backend`), for GPU volunteers (CUDA
when present, CPU otherwise); full-parameter updates are applied to the weights in place, as a
llama.cpp node holds them: requantized to the base file's type (`full_weights.requantized`).

Sampling runs in a plain KV-cached decoding loop; each token's logprob is log-softmax(logits / T)
of the raw logits that produced it: the distribution sampled from.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from engines.backend import Completion, Follow, Meter, Request, hardware_summary
from engines.full_weights import file_type, requantized
from engines.gguf_io import FILE_TYPES
from engines.hf import cache_field, decode, distinct_weights, load_model, load_tokenizer
from engines.sampler import sample_rows


class TransformersBackend:
    name = "transformers"
    parallel = 1  # decodes one sequence at a time

    def __init__(self, model_path: Path, threads: int = 0, n_ctx: int = 2048):
        """`n_ctx`: each sequence's window, tokens (the run's `engines.episodes.context_window`)."""
        if threads:
            torch.set_num_threads(threads)
        model = load_model(model_path, dtype=torch.float32)
        self._use(model, load_tokenizer(model_path), n_ctx)
        self.model_path = Path(model_path)
        # The base GGUF's quant type, which every version's weights are rounded to (f32: none).
        self.file_type = file_type(self.model_path) if self.model_path.is_file() else FILE_TYPES["f32"]
        # Master copy on the CPU: updates apply here bit-exactly, then copy into the model.
        self.master = distinct_weights(self.model)

    @classmethod
    def of_model(cls, model, tokenizer, n_ctx: int) -> TransformersBackend:
        """Generate with a model already in memory (the trainer's, for `echo-coordinator eval`)."""
        backend = cls.__new__(cls)
        backend._use(model, tokenizer, n_ctx)
        return backend

    def _use(self, model, tokenizer, n_ctx: int) -> None:
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = model.to(self.device).eval()
        self.cache_field = cache_field(model)
        gpu = f"CUDA {torch.cuda.get_device_name()}" if self.device == "cuda" else None
        self.hardware = hardware_summary(gpu, torch.get_num_threads())
        self.config = model.config
        self.vocab_size = model.config.vocab_size
        self.eos = model.config.eos_token_id
        self.n_ctx = n_ctx
        self.tokenizer = tokenizer
        self.meter = Meter()

    def generate(self, requests: list[Request], temperature: float, follow: Follow | None = None) -> list[Completion]:
        """`engines.backend.Backend.generate`, one sequence at a time."""
        out = []
        for index, request in enumerate(requests):
            while request is not None:
                done = self._one(request, temperature)
                request = follow(index, done) if follow is not None else None
            out.append(done)
        return out

    @torch.no_grad()
    def _one(self, request: Request, temperature: float) -> Completion:
        started = time.perf_counter()
        tokens: list[int] = []
        logprobs: list[float] = []
        step = torch.tensor([request.prompt_ids], device=self.device)
        cache = None
        limit = min(request.max_new_tokens, self.n_ctx - len(request.prompt_ids))
        while len(tokens) < limit:
            out = self.model(input_ids=step, use_cache=True, **{self.cache_field: cache})
            cache = getattr(out, self.cache_field)
            row = out.logits[:, -1].float().cpu().numpy()  # (1, V)
            token, logprob = sample_rows(row, temperature, [request.seed], [request.offset + len(tokens)])
            tokens.append(int(token[0]))
            logprobs.append(float(logprob[0]))
            if tokens[-1] == self.eos:
                break
            step = torch.tensor([[tokens[-1]]], device=self.device)
        self.meter.add(len(tokens), started)
        return Completion(tuple(tokens), tuple(logprobs))

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def detokenize(self, ids: tuple[int, ...]) -> str:
        return decode(self.tokenizer, ids)

    @property
    def throughput(self) -> float:
        return self.meter.rate

    def base_weights(self):
        return self.config, self.master

    def set_adapter(self, path: Path | None) -> None:
        raise ValueError("the transformers backend takes full-parameter runs only")

    @torch.no_grad()
    def load_weights(self, master: dict[str, np.ndarray], version: int, workdir: Path) -> None:
        """Copy master tensors into the model in place (a tied lm_head follows embed_tokens),
        requantized as a llama.cpp node's re-export is (through a file in `workdir`), so that the
        verifier's one view of what nodes hold is this node's too."""
        workdir.mkdir(parents=True, exist_ok=True)
        held = requantized(self.config, master, self.model_path, workdir / f"v{version}.gguf", self.file_type)
        params = self.model.state_dict()
        for name, value in held.items():
            params[name].copy_(torch.from_numpy(value))
            self.master[name] = master[name]
