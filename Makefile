# Everything a fresh Debian machine (run as root) needs to run kvfs or its tests.
VENV   ?= .venv
PYTHON ?= python3
DATA   ?= .kvfs
MOUNT  ?= mnt
DEB_PACKAGES := fuse3 libfuse3-dev pkg-config gcc python3-dev python3-venv git \
                openssh-server openssh-client iproute2 python3-apt

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: venv up down status test clean deb

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

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
