VENV ?= .venv

.PHONY: install demo test lint bench-ratio

$(VENV)/.installed: pyproject.toml benchmarks/pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV)

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/kvcodec demo

test: install
	$(VENV)/bin/python -m pytest -q
	$(MAKE) lint

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench-ratio: install
	$(VENV)/bin/kvcodec bench ratio
