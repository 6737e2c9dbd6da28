VENV ?= .venv

.PHONY: install demo test bench-ratio

$(VENV)/.installed: pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV)

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/kvcodec demo

test: install
	$(VENV)/bin/python -m pytest -q

bench-ratio: install
	$(VENV)/bin/kvcodec bench ratio
