# Baton: set-up, build and test entry points. Every target is idempotent and cheap to re-run.
#
#   make demo    # everything, then a split-model run on SmolLM2 (the quick start)
#   make test    # everything, then lint + types, the native (ctest) and Python (pytest) tests
#
# Variables: CMAKE_ARGS (extra CMake flags, e.g. CMAKE_ARGS=-DGGML_CUDA=ON), PYTHON (the
# interpreter that makes .venv, default python3), BATON_CACHE (download cache, default
# ~/.cache/baton). Paths follow docs/LAYOUT.md.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
CMAKE_ARGS ?=
VENV := .venv
VPY := $(VENV)/bin/python
VENV_STAMP := $(VENV)/.baton-installed
# pip >= 25.0 reads the PEP 639 license (`pip show baton` names it); Debian 12's python3-venv ships 23.0.
PIP_PIN := pip==26.3
PROTO_OUT := agent/_proto/worker_pb2_grpc.py
NATIVE_BUILD := build/native
NATIVE_CONFIG_RECORD := $(NATIVE_BUILD)/.baton-configure
NPROC := $(shell nproc 2>/dev/null || echo 2)

# Debian/Ubuntu packages: toolchain, gRPC C++ 1.51 + protobuf (worker), OpenSSL, GMP
# (fastecdsa, pulled by libp2p), Python with venv, Chromium (the relay's status page is tested
# in headless Chromium: agent/harness/browser.py), iproute2 (the lab's namespaces), doctest (C++ tests).
APT_PACKAGES := build-essential cmake ccache pkg-config git libgrpc++-dev \
	protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libssl-dev libgmp-dev \
	python3 python3-venv chromium iproute2 doctest-dev
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
CCACHE_FLAGS := $(if $(shell command -v ccache 2>/dev/null),\
	-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)

# Prints the cached, verified path of a pinned model (fetching it if needed).
MODEL_PATH := $(VPY) -c 'import sys; from agent.models import model_path; print(model_path(sys.argv[1]))'

.PHONY: help deps venv proto llama check-patches native models lint client-venvs demo test clean distclean

help:
	@echo "make demo   - install everything, build, fetch models, run the demo"
	@echo "make test   - install everything, build, fetch models, run ruff + mypy, ctest, pytest"
	@echo "parts: deps venv llama check-patches native models lint client-venvs clean distclean"

deps:
	@if ! command -v dpkg-query >/dev/null; then \
	  echo "deps: not a Debian/Ubuntu system; install the equivalents of: $(APT_PACKAGES)" >&2; \
	  exit 0; \
	fi; \
	missing=""; \
	for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' "$$p" 2>/dev/null | grep -q ' installed$$' || missing="$$missing $$p"; \
	done; \
	if [ -z "$$missing" ]; then echo "deps: all Debian packages present"; exit 0; fi; \
	echo "deps: installing$$missing"; \
	$(SUDO) apt-get update; \
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing

venv: $(VENV_STAMP) proto

# Re-installed only when pyproject.toml is newer than the stamp.
$(VENV_STAMP): pyproject.toml | deps
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check $(PIP_PIN)
	$(VPY) -m pip install --quiet --disable-pip-version-check -e '.[test,bench]'
	touch $@

proto: $(PROTO_OUT)

$(PROTO_OUT): $(wildcard protocol/*.proto) packaging/gen_proto.py $(VENV_STAMP)
	$(VPY) packaging/gen_proto.py --force

# Stdlib only: runs with the system Python, before the venv exists.
llama: | deps
	$(PYTHON) packaging/llama_source.py prepare

check-patches: | deps
	$(PYTHON) packaging/llama_source.py check-patches

# Configures only when the build dir is new or the tree (stamp), the pin or CMAKE_ARGS changed.
native: llama
	@if [ ! -f native/CMakeLists.txt ]; then \
	  echo "native: native/CMakeLists.txt is missing; the worker's CMake project is not in this checkout" >&2; \
	  exit 1; \
	fi
	@commit=$$($(PYTHON) packaging/llama_source.py commit); \
	series=$$($(PYTHON) packaging/llama_source.py series-hash); \
	record="$$commit $$(tr -d ' \n' < build/llama.cpp.stamp) $(CMAKE_ARGS) $(CCACHE_FLAGS)"; \
	if [ ! -f $(NATIVE_BUILD)/CMakeCache.txt ] || [ "$$(cat $(NATIVE_CONFIG_RECORD) 2>/dev/null)" != "$$record" ]; then \
	  set -x; \
	  cmake -S native -B $(NATIVE_BUILD) \
	    -DBATON_LLAMA_SRC=$(CURDIR)/build/llama.cpp \
	    -DBATON_LLAMA_COMMIT=$$commit \
	    -DBATON_PATCH_SERIES_SHA256=$$series \
	    -DCMAKE_BUILD_TYPE=Release \
	    $(CCACHE_FLAGS) $(CMAKE_ARGS); \
	  { set +x; } 2>/dev/null; \
	  echo "$$record" > $(NATIVE_CONFIG_RECORD); \
	fi
	cmake --build $(NATIVE_BUILD) -j$(NPROC)

models: venv
	$(VPY) packaging/fetch_models.py

# SmolLM2 through a local swarm (a tracker, three nodes serving [0,10) [10,20) [20,30), the relay): streamed
# text, tokens/s, and whether the tokens equal one unsplit worker's.
demo: deps venv llama native models
	$(VENV)/bin/baton demo --model "$$($(MODEL_PATH) smollm2)"

# ruff (lint, then format) and mypy, configured in pyproject.toml: the same checks on every tree.
lint: venv
	$(VPY) -m ruff check
	$(VPY) -m ruff format --check
	$(VPY) -m mypy

# Third-party clients whose pins cannot live in the project's venv, each in a venv of its own
# (tests/clients/*-requirements.txt say why); re-made when its requirements change.
INSTRUCTOR_VENV := build/venv-instructor
$(INSTRUCTOR_VENV)/.installed: tests/clients/instructor-requirements.txt | deps
	test -x $(INSTRUCTOR_VENV)/bin/python || $(PYTHON) -m venv $(INSTRUCTOR_VENV)
	$(INSTRUCTOR_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r $<
	touch $@

client-venvs: $(INSTRUCTOR_VENV)/.installed

test: deps venv llama native models lint client-venvs
	BATON_TEST_MODEL="$$($(MODEL_PATH) smollm2)" ctest --test-dir $(NATIVE_BUILD) --output-on-failure
	$(VPY) -m pytest -q -p no:cacheprovider

clean:
	rm -rf build agent/_proto

distclean: clean
	rm -rf $(VENV)
