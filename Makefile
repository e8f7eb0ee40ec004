# `make train` runs the main job on the embedded defaults; `make test` runs the test suite;
# `make bench` writes docs/benchmarks.md (bench/run_all.py; TRL in .venv-bench);
# `make report` writes RUN's HTML report (default: the main job's run folder) to RUN/report.html.
# All create the virtual environment first (once; re-run only when pyproject.toml changes).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BVENV := .venv-bench
BPY := $(BVENV)/bin/python
BSTAMP := $(BVENV)/.installed
ARGS ?=
RUN ?= runs/grpo-smollm2-chain-sum

.PHONY: setup train test bench report diagnose
setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# the local CPU build of torch first, so nothing pulls a CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/nearpolicy train configs/main.toml $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

report: $(STAMP)
	$(VENV)/bin/nearpolicy report $(RUN)

# docs/benchmarks.md and .json: nearpolicy side by side with transformers generate and TRL (bench/run_all.py).
# TRL lives in its own environment .venv-bench (nearpolicy[bench]), built once; ARGS=--quick for a smoke run.
$(BSTAMP): pyproject.toml $(STAMP)
	test -x $(BPY) || $(PYTHON) -m venv $(BVENV)
	$(BPY) -m pip install --quiet --upgrade pip
	$(BPY) -m pip install --quiet torch==2.13.0
	$(BPY) -m pip install --quiet -e '.[bench]'
	touch $(BSTAMP)

bench: $(STAMP) $(BSTAMP)
	$(PY) bench/run_all.py --trl-python $(BPY) $(ARGS)

# docs/results.md section 3: the diagnose table, admission verdicts and q4_1 sensitivity of SmolLM2-135M-Instruct
diagnose: $(STAMP)
	$(VENV)/bin/nearpolicy diagnose configs/main.toml --set run.threads=1 --out docs/diagnose/smollm2 --sensitivity q4_1 --sensitivity-prompts 4 --propose $(ARGS)
