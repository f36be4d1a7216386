"""The node's llama.cpp settings per backend: what it tries, what fits a volunteer's GPU memory, and
a backend that crashes costing a probe process instead of the node."""

import signal
import sys

import pytest

from echo_coordinator.main import demo_model_path
from engines import llama_device, llama_probe
from engines.llama_device import ContextSettings, DeviceError, ModelSizes, device_bytes, fit, model_sizes

F32, F16_FA = ContextSettings("f32", False), ContextSettings("f16", True)


def test_the_cpu_keeps_fp32_and_a_gpu_tries_what_its_kernels_are_built_for_then_fp32():
    assert llama_device.candidates(offloaded=False) == [F32]
    assert llama_device.candidates(offloaded=True) == [F16_FA, F32]
    assert llama_device.candidates(offloaded=True, kv="f16") == [F16_FA]
    with pytest.raises(ValueError, match="--kv must be one of f32, f16"):
        llama_device.candidates(True, "q8_0")


def test_the_sizes_read_from_a_gguf_are_the_models():
    sizes = model_sizes(demo_model_path())  # SmolLM2-135M: 30 layers, 3 KV heads of 64, 49,152 tokens
    assert (sizes.n_layers, sizes.kv_width, sizes.n_head, sizes.vocab) == (30, 2 * 3 * 64, 9, 49152)
    # Layers and the rest add up to the file's tensors (llama.cpp reported 92.1 MiB offloaded on Vulkan).
    assert 85 < (sizes.n_layers * sizes.layer_bytes + sizes.other_bytes) / 2**20 < 100


SEVEN_B = ModelSizes(layer_bytes=140 * 2**20, other_bytes=600 * 2**20, n_layers=28, kv_width=2 * 4 * 128, n_head=28,
                     vocab=152064)  # a Qwen2.5-7B q4_k_m's proportions


@pytest.mark.parametrize("gib", [2, 4, 6, 8, 12, 24])
def test_what_fits_a_budget_stays_within_it_and_prefers_every_layer_to_a_wide_batch(gib):
    budget = gib * 2**30
    layers, parallel = fit(SEVEN_B, budget, 64, 2048, F32)
    if layers:
        assert device_bytes(SEVEN_B, layers, parallel, 2048, F32) <= budget
    if layers == SEVEN_B.n_layers:  # the widest batch that fits with every layer on the device
        assert parallel == 64 or device_bytes(SEVEN_B, layers, parallel * 2, 2048, F32) > budget
    else:  # some layers stay on the CPU only when one sequence does not fit with all of them
        assert device_bytes(SEVEN_B, SEVEN_B.n_layers, 1, 2048, F32) > budget
        assert layers == 0 or device_bytes(SEVEN_B, layers + 1, parallel, 2048, F32) > budget


def test_more_memory_never_means_less_on_the_device():
    fits = [fit(SEVEN_B, gib * 2**30, 64, 2048, F32) for gib in range(1, 40)]
    assert fits == sorted(fits) and fits[0] == (0, 8) and fits[-1] == (28, 64)
    assert fit(SEVEN_B, 8 * 2**30, 64, 2048, F16_FA) >= fit(SEVEN_B, 8 * 2**30, 64, 2048, F32)  # fp16 KV is smaller


def crash_for(settings_crashing):
    """probe_command, except that the probe for each settings in `settings_crashing` dies by SIGSEGV."""
    real = llama_probe.probe_command

    def command(model, gpu_layers, parallel, window, settings):
        if settings in settings_crashing:
            return [sys.executable, "-c", f"import os; os.kill(os.getpid(), {int(signal.SIGSEGV)})"]
        return real(model, gpu_layers, parallel, window, settings)
    return command


def test_a_setting_that_crashes_llama_cpp_costs_a_probe_and_the_next_one_is_used(monkeypatch):
    monkeypatch.setattr(llama_probe, "probe_command", crash_for({F16_FA}))
    # The second candidate's probe is real: llama.cpp loads the model and decodes 4 sequences.
    tries = [llama_probe.Placement(F16_FA, 0, 4), llama_probe.Placement(F32, 0, 4)]
    assert llama_probe.choose(demo_model_path(), 64, tries) == tries[1]


def test_when_every_setting_crashes_the_node_says_why_and_what_to_try(monkeypatch):
    monkeypatch.setattr(llama_probe, "probe_command", crash_for({F32, F16_FA}))
    with pytest.raises(DeviceError) as e:
        llama_probe.choose(demo_model_path(), 2048, [llama_probe.Placement(F16_FA, -1, 32), llama_probe.Placement(F32, -1, 32)])
    said = str(e.value)
    assert "f32 KV: llama.cpp crashed (SIGSEGV)" in said and "f16 KV + flash attention: llama.cpp crashed" in said
    assert "--gpu-layers 0" in said and "--parallel" in said and "\n" not in said


def test_a_probe_that_cannot_load_says_what_llama_cpp_said(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(range(64)))  # fixed bytes: random ones could meet a parser crash
    failure = llama_probe.probe(broken, 0, 2, 64, F32)
    assert failure is not None and "crashed" not in failure


def test_max_vram_fits_each_setting_on_its_own_and_says_what_it_chose(monkeypatch):
    model, probed, sizes = demo_model_path(), [], model_sizes(demo_model_path())
    monkeypatch.setattr(llama_device, "model_sizes", lambda path: sizes)  # read once: seconds for 49k tokens

    def probe(model, layers, parallel, window, settings, timeout, sandbox=True):  # F16_FA "crashes" once asked to
        probed.append(settings)
        return "llama.cpp crashed (SIGSEGV)" if settings in crashing else None
    monkeypatch.setattr(llama_probe, "probe", probe)
    crashing = set()
    placed = llama_probe.place(model, True, -1, 32, 512, max_vram_gib=0.5)
    assert placed.settings == F16_FA and placed.gpu_layers == 30 and 1 <= placed.parallel < 32
    assert placed.fitted.startswith("--max-vram 0.5 GiB: 30/30 layers on the GPU, ") and "f16 KV" in placed.fitted
    assert device_bytes(sizes, 30, placed.parallel, 512, F16_FA) <= 0.5 * 2**30
    crashing.add(F16_FA)  # the fp32 cache, fitted for itself: fewer sequences in the same memory
    fallback = llama_probe.place(model, True, -1, 32, 512, max_vram_gib=0.5)
    assert fallback.settings == F32 and fallback.parallel < placed.parallel and "f32 KV" in fallback.fitted
    assert device_bytes(sizes, 30, fallback.parallel, 512, F32) <= 0.5 * 2**30
    ten = llama_probe.place(model, True, 10, 32, 512, max_vram_gib=8)
    assert (ten.gpu_layers, ten.parallel) == (10, 32)  # --gpu-layers 10 holds
    probed.clear()  # no layer fits 0.1 GiB, and the CPU needs no probe: the CPU's settings, said
    tiny = llama_probe.place(model, True, -1, 32, 512, max_vram_gib=0.1)
    assert (tiny.settings, tiny.gpu_layers) == (F32, 0) and tiny.fitted.startswith("--max-vram 0.1 GiB: 0/30 layers")
    assert llama_probe.place(model, False, 0, 32, 512, max_vram_gib=8) == llama_probe.Placement(
        F32, 0, 32, "--max-vram has no effect: the model runs on the CPU")
    assert probed == []
