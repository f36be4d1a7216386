"""A mixture of experts with its expert tensors kept in system RAM (`--cpu-moe`, `--n-cpu-moe`),
built through llama.cpp's tensor buffer-type overrides. On a CPU build every buffer is host
memory, so the model must generate exactly what the default load generates; that llama.cpp reads
the overrides at all shows in a pattern it cannot compile failing the load."""

import numpy as np
import pytest

from echo_coordinator.base_model import prepare
from engines import llama_overrides
from engines.backend import generate_one
from engines.llama_backend import LlamaBackend
from tests.support.tiny_model import build_tiny_checkpoint

PROMPTS = [tuple(range(100 + i, 116 + i)) for i in range(3)]


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    work = tmp_path_factory.mktemp("moe")
    return prepare(str(build_tiny_checkpoint(work / "checkpoint", "qwen3_moe", init_std=0.2)), "q8_0",
                   work / "cache").node_gguf


def outputs(backend: LlamaBackend):
    return [generate_one(backend, prompt, 12, 1.0, seed=i) for i, prompt in enumerate(PROMPTS)]


def test_experts_in_ram_generate_what_the_default_load_generates(moe_gguf):
    default = outputs(LlamaBackend(moe_gguf, threads=1, n_ctx=128))
    for options, said in ((dict(cpu_moe=True), "experts in RAM (every layer)"),
                          (dict(n_cpu_moe=1), "experts in RAM (first 1 of 2 layers)")):
        backend = LlamaBackend(moe_gguf, threads=1, n_ctx=128, **options)
        assert said in backend.hardware
        for got, want in zip(outputs(backend), default):
            assert got.token_ids == want.token_ids and np.allclose(got.logprobs, want.logprobs, atol=1e-6)


def test_llama_cpp_reads_the_overrides(moe_gguf, monkeypatch):
    monkeypatch.setattr(llama_overrides, "expert_patterns", lambda layers: ["(unclosed"])
    with pytest.raises(ValueError):
        LlamaBackend(moe_gguf, threads=1, n_ctx=128, cpu_moe=True)
