# `make train` runs the main job on the embedded defaults; `make test` runs the test suite;
# `make report` writes RUN's HTML report (default: the main job's run folder) to RUN/report.html.
# All create the virtual environment first (once; re-run only when pyproject.toml changes).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
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

bench: $(STAMP)
	$(PY) bench/rollout_throughput.py

# docs/results.md section 3: the diagnose table, admission verdicts and q4_1 sensitivity of SmolLM2-135M-Instruct
diagnose: $(STAMP)
	$(VENV)/bin/nearpolicy diagnose configs/main.toml --set run.threads=1 --out docs/diagnose/smollm2 --sensitivity q4_1 --sensitivity-prompts 4 --propose $(ARGS)
