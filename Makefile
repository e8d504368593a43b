# Two commands do all the set-up on a fresh machine:
#   make demo   -> venv + install + run the main job on the demo model
#   make test   -> venv + install + run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: install demo test test-extra test-heavy lint llama-cpp clean

$(BIN)/mtpq: pyproject.toml constraints/ci.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints/ci.txt -e '.[test]'
	touch $(BIN)/mtpq

install: $(BIN)/mtpq

demo: install
	$(BIN)/mtpq demo --workdir demo-out

test: install
	$(BIN)/python -m pytest -q

# ruff (settings in pyproject.toml): lint and format, checked, never rewritten here (`ruff format .` fixes)
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test-extra: install
	$(BIN)/python -m pytest -q -m "(slow or llama_cpp) and not heavy" || [ $$? -eq 5 ]  # 5 = nothing selected

test-heavy: install
	$(BIN)/python -m pytest -q -m heavy

# llama.cpp for the cross-checks: the pinned tree built into ~/.cache/mtpq (reused), its bin folder printed last
llama-cpp:
	scripts/build_llama_cpp.sh

clean:
	rm -rf $(VENV) demo-out
