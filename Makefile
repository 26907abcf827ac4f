# lora-lab: `make demo` and `make test` are all a fresh machine needs. `make demo` installs only
# what the demo trains with (PyTorch and lora-lab's own dependencies); `make test` adds what the
# tests need (the test extra, chromium, llm-compressor, llama.cpp).
PYTHON ?= python3
PIP = $(PYTHON) -m pip
PRESET ?= 24gb
MODEL ?= qwen2.5-7b
DATA ?=
GPUS ?= 1
# engine for GPUS > 1: ddp, deepspeed-zero2, deepspeed-zero2-offload, deepspeed-zero3,
# deepspeed-zero3-offload or fsdp (default: the run config's train.engine, ddp)
ENGINE ?=
# several machines: NODES=N, this machine's NODE_RANK (0 .. N-1) and node 0's MAIN_ADDRESS
# HOST[:PORT], the same make command on each (docs/multi-gpu.md, several nodes)
NODES ?= 1
NODE_RANK ?= 0
MAIN_ADDRESS ?=
RUN_NAME ?=
STAMP = .install.stamp
TEST_STAMP = .test-deps.stamp
# e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" where no CPU wheel is at hand
TORCH_PIP_ARGS ?=
# llama.cpp for the GGUF export (lora-lab[gguf]): llama-cpp-python has no wheel on PyPI, so its
# source is built once (about 15-35 min on 2 cores) and the wheel kept in WHEELS; its sdist stays
# there too, as the source of llama.cpp's convert_hf_to_gguf.py (lora_lab/use/gguf_export.py).
LLAMA_CPP_VERSION = 0.3.36
WHEELS ?= $(HOME)/.cache/lora-lab/wheels
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF

.PHONY: install test-deps chromium llama-cpp demo lint test test-fast test-slow test-gpu finetune bench clean

install: $(STAMP)

# torch first: the CPU build (2.13.0) on machines without an NVIDIA GPU, so that the
# unpinned requirement below does not pull a multi-GB CUDA build. Then lora-lab (editable) with
# its own dependencies only: each extra is installed when a command needs it, which says so.
$(STAMP): setup.cfg pyproject.toml
	@if ! $(PYTHON) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install torch; \
	  else $(PIP) install torch==2.13.0 $(TORCH_PIP_ARGS); fi; \
	fi
	$(PIP) install -q -e .
	@touch $(STAMP)

# what the tests need beyond `make install`: the test extra (trackers, trl, gradio, playwright,
# pytest-xdist, build), the browser, llm-compressor and llama.cpp
test-deps: $(TEST_STAMP)

$(TEST_STAMP): $(STAMP)
	$(PIP) install -q -e ".[test]"
	$(MAKE) --no-print-directory chromium
	# the w4a16 export's library, for its tests; --no-deps: llmcompressor pins transformers
	# <= 5.17 and declares packages its GPTQ path never imports (setup.cfg, extra "export")
	$(PIP) install -q --no-deps llmcompressor==0.14.0.1 compressed-tensors==0.19.0 loguru==0.7.3
	$(MAKE) --no-print-directory llama-cpp
	@touch $(TEST_STAMP)

# the browser of the `lora-lab ui` test: Debian's chromium (Playwright drives it; its own browser
# download is not used), through apt-get where it is missing (as root, or with sudo)
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium; \
	    else sudo apt-get update -qq && sudo apt-get install -y -qq chromium; fi; }

# the GGUF export's llama.cpp (extra "gguf"): the cached wheel, built from the sdist when absent
llama-cpp:
	@mkdir -p $(WHEELS)
	@test -f $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz || \
	  $(PIP) download -q --no-deps --no-binary :all: -d $(WHEELS) \
	    llama-cpp-python==$(LLAMA_CPP_VERSION)
	@if ! ls $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1; then \
	  echo "building llama.cpp (llama-cpp-python $(LLAMA_CPP_VERSION)) from source, once"; \
	  CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PIP) wheel -q --no-deps -w $(WHEELS) \
	    $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz; \
	fi
	$(PIP) install -q --find-links $(WHEELS) --only-binary llama-cpp-python \
	  llama-cpp-python==$(LLAMA_CPP_VERSION) sentencepiece

demo: install
	lora-lab demo

# -q: one letter per test; each real-model test (minutes) prints its name and time on a line of
# its own (tests/support/progress.py); the ten slowest tests are listed at the end. Two workers
# (pytest-xdist), each test file in one worker, so that a file's shared fixtures (a tiny run, the
# real model's fine-tune) are built once; the model caches of ~/.cache/lora-lab are written under
# a lock or renamed into place, so both workers may ask for a model. PYTEST_WORKERS= runs in one
# process.
PYTEST_WORKERS ?= -n 2 --dist loadfile
PYTEST = $(PYTHON) -m pytest -q --durations=10 $(PYTEST_WORKERS)

# ruff (pyproject.toml's [tool.ruff]) and mypy on lora_lab/ ([tool.mypy]); make test runs it first
lint: test-deps
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

test: test-deps lint
	$(PYTEST) tests/unit tests/e2e bench/tests

test-fast: test-deps
	$(PYTEST) tests/unit tests/e2e bench/tests -m "not real_model"

test-slow: test-deps
	LORA_LAB_SLOW=1 $(PYTEST) tests/unit tests/e2e -m slow

test-gpu: install
	$(PIP) install -q "pytest>=8"
	$(PYTHON) -m pytest -q tests/gpu

finetune: install
	@if [ -z "$(DATA)" ]; then echo "usage: make finetune DATA=my.jsonl [MODEL=qwen2.5-7b] [PRESET=24gb] [GPUS=2 [ENGINE=deepspeed-zero2]] [NODES=2 NODE_RANK=0 MAIN_ADDRESS=host:29500 RUN_NAME=name]"; exit 2; fi
	lora-lab run --preset $(PRESET) --model $(MODEL) $(foreach d,$(DATA),--data $(d)) --gpus $(GPUS)$(if $(ENGINE), --engine $(ENGINE))$(if $(filter-out 1,$(NODES)), --nodes $(NODES) --node-rank $(NODE_RANK))$(if $(MAIN_ADDRESS), --main-address $(MAIN_ADDRESS))$(if $(RUN_NAME), --run-name $(RUN_NAME))

clean:
	rm -rf $(STAMP) $(TEST_STAMP) build dist *.egg-info .pytest_cache
