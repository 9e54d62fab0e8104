# Set-up is part of every target: a fresh clone runs `make test` or `make demo` alone.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# This machine's pip serves a CPU build of torch 2.13.0 from local disk; any other
# torch request would download a multi-GB CUDA build, so the pin lives here.
TORCH   := torch==2.13.0
export HYPOTHESIS_PROFILE ?= ci

.PHONY: demo test check format lint typecheck docs unit browser fuzz conformance bench bench-quick clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH)"
	$(VPY) -m pip install -q -e ".[test,dev,hf,triton,docs,recipes]" "$(TORCH)"
	# torchtitan and torchtune (tests/integration/test_recipes.py): what they need to import
	# comes with the recipes extra; their other requirements are for their own trainers.
	# torchtitan 0.2.2: 0.3.0's models train only with flex attention, whose backward has
	# no CPU kernel
	$(VPY) -m pip install -q --no-deps torchtitan==0.2.2 torchdata==0.11.0
	# torchtune 0.6.1 needs torchao <= 0.15 (int4_weight_only), and peft refuses to import
	# beside a torchao < 0.16: both go to a folder of their own, which only the torchtune
	# test's subprocess puts on its path
	$(VPY) -m pip install -q --no-deps --upgrade --target $(VENV)/torchtune \
		torchtune==0.6.1 torchao==0.15.0
	$(VPY) -m functrans.codegen._native  # the native executor, built once here, not at a first call
	touch $(STAMP)

demo: $(STAMP)
	$(VPY) examples/quickstart.py

lint: $(STAMP)
	$(VPY) -m ruff check .
	$(VPY) -m ruff format --check .

typecheck: $(STAMP)
	$(VPY) -m mypy

# rewrite what ruff can fix and format the tree
format: $(STAMP)
	$(VPY) -m ruff check --fix .
	$(VPY) -m ruff format .

# tests/viz/test_report_browser.py renders the HTML report in Debian's Chromium, installed here
# when missing
# (as root, else through sudo); FUNCTRANS_REQUIRE_BROWSER=1 makes its absence a failure.
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	command -v chromium >/dev/null || { $(SUDO) apt-get update && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive \
		apt-get install -y --no-install-recommends chromium; }

# two workers (pytest-xdist): the suite is mostly single-threaded Python, one per core
unit: $(STAMP) browser
	FUNCTRANS_REQUIRE_BROWSER=1 $(VPY) -m pytest -q -n 2

# the documentation site (docs/, mkdocs.yml) into site/; --strict: a warning fails the build.
# Offline: no plugin fetches anything, and the theme links no web fonts.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VPY) -m mkdocs build --strict --quiet --site-dir site

test: lint typecheck docs unit

# the quick loop while working: lint, types and the unit tests, without installing Chromium
# (the browser test skips) and without building the docs
check: lint typecheck
	$(VPY) -m pytest -q -n 2

fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=nightly $(VPY) -m pytest -q -n 2 tests -k "property"

# Every OpInfo with float32 autograd on CPU through trace, joint and every strategy; rewrites
# tests/conformance/opinfo_status.json (FUNCTRANS_CONFORMANCE_SAMPLES caps samples per op).
conformance: $(STAMP)
	FUNCTRANS_CONFORMANCE=full $(VPY) -m pytest -q tests/conformance -k full_sweep

clean:
	rm -rf $(VENV) *.egg-info .mypy_cache .ruff_cache

bench: $(STAMP)
	$(VPY) -m benchmarks.partition_quality
	$(VPY) -m benchmarks.partition_speed
	$(VPY) -m benchmarks.memory_budget
	$(VPY) -m benchmarks.offload
	$(VPY) -m benchmarks.peak_memory
	$(VPY) -m benchmarks.remat
	$(VPY) -m benchmarks.runtime
	$(VPY) -m benchmarks.dynamic
	$(VPY) -m benchmarks.codegen
	$(VPY) -m benchmarks.compose
	$(VPY) -m benchmarks.distributed
	$(VPY) -m benchmarks.compile_time
	$(VPY) -m benchmarks.staged
	$(VPY) -m benchmarks.regions_step
	$(VPY) -m benchmarks.bn_step

bench-quick: $(STAMP)
	$(VPY) -m benchmarks.partition_quality --quick
	$(VPY) -m benchmarks.partition_speed --quick
	$(VPY) -m benchmarks.memory_budget --quick
	$(VPY) -m benchmarks.offload --quick
	$(VPY) -m benchmarks.peak_memory --quick
	$(VPY) -m benchmarks.remat --quick
	$(VPY) -m benchmarks.runtime --quick
	$(VPY) -m benchmarks.codegen --quick
	$(VPY) -m benchmarks.compose --quick --no-compile
	$(VPY) -m benchmarks.distributed --quick --no-compile
	$(VPY) -m benchmarks.compile_time --quick --no-inductor --repeats 1
	$(VPY) -m benchmarks.bn_step --quick
