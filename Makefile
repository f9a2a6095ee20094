# Two entry points: `make demo` and `make test`. Both install whatever is missing first.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-unit test-bpf test-netns gen p4 p4info clean

setup:
	@bash scripts/setup.sh

demo: setup
	@$(VENV)/bin/aggctl demo

# The suite in TEST_JOBS pytest processes (pytest-xdist; `TEST_JOBS=0` for one): most tests are real labs,
# daemons and training runs, and every test names its namespaces, links, pin dirs and sockets uniquely.
TEST_JOBS ?= 2

test: setup
	@start=$$(date +%s); \
	$(PY) -m pytest tests -n $(TEST_JOBS) --dist worksteal --durations=60; rc=$$?; \
	echo "make test: $$(( $$(date +%s) - start ))s"; exit $$rc

test-unit: setup
	$(PY) -m pytest tests/unit tests/client

gen: setup
	$(PY) -m aggd_client.protocol.codegen --write

# The P4 programs (docs/p4.md): compiled by p4c-bm2-ss (BMv2) and/or bf-p4c (Tofino) where installed;
# fails, saying where they come from, when neither is. P4FLAGS="-DAGGD_ELEMENTS=128" for other sizes.
p4:
	@bash aggd/dataplane/p4/programs/build.sh

# The committed P4Info files, from the programs' declarations (no compiler needed).
p4info: setup
	$(PY) -m aggd.dataplane.p4.p4info_gen --write

clean:
	rm -rf $(VENV) .pytest_cache
