# Two entry points: `make demo` and `make test`. Both install whatever is missing first.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-unit test-bpf test-netns gen clean

setup:
	@bash scripts/setup.sh

demo: setup
	@$(VENV)/bin/aggctl demo

test: setup
	@start=$$(date +%s); \
	$(PY) -m pytest tests; rc=$$?; \
	echo "make test: $$(( $$(date +%s) - start ))s"; exit $$rc

test-unit: setup
	$(PY) -m pytest tests/unit

gen: setup
	$(PY) -m aggd_client.protocol.codegen --write

clean:
	rm -rf $(VENV) .pytest_cache
