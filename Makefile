# The two commands (SPEC §9): `make demo` and `make test`. Both bootstrap .venv on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.k3-installed

.PHONY: demo agent-demo distill-demo vision-demo test install chromium sandbox-deps vm-deps cc bench docs-figures gpu-check clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch is pinned to the CPU build that lies on local disk; install it first so nothing pulls a CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP) cc
	$(BIN)/k3 demo

# SFT of a pretrained tiny K3 on the task families, held-out evaluation in real sandboxes
# (docs/POSTTRAINING.md). Pretrains its base (runs/agent-base, the agent base recipe) first when it is missing.
agent-demo: $(STAMP) cc sandbox-deps
	$(BIN)/k3 agent-demo

# Nine teachers (3 domains x 3 efforts) fine-tuned from the agent base, one student distilled from
# them on-policy, and two baselines at the same steps: SFT on the teachers' samples, RL from the
# verifier (docs/DISTILL.md). Pretrains runs/agent-base first when it is missing.
distill-demo: $(STAMP) cc sandbox-deps
	$(BIN)/python benchmarks/distill_demo.py

# A tiny model with a vision tower learns synthetic image questions; a text-only control gets the
# same questions without the images (docs/VISION.md). Pretrains runs/vision-base first when missing.
vision-demo: $(STAMP) cc
	$(BIN)/k3 vision-demo

# The chat page test drives Debian's chromium headless; install it when missing (root, or sudo).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
chromium:
	command -v chromium >/dev/null || { $(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q chromium; }

# The decode step's packed matmul (k3.ops.packed_mm) is C, compiled on first use; install a compiler when missing.
cc:
	command -v cc >/dev/null || { $(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q gcc libc6-dev; }

# The namespace sandbox backend (k3.env) runs on Debian's bubblewrap; install it when missing.
sandbox-deps:
	command -v bwrap >/dev/null || { $(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q bubblewrap; }

# The vm sandbox backend (k3.env.backends.vm) needs QEMU, zstd (snapshot files) and a guest: a Debian kernel and busybox,
# fetched with apt-get download into ~/.cache/k3/vm (K3_VM_CACHE); nothing downloads at test time.
vm-deps: $(STAMP)
	command -v qemu-system-x86_64 >/dev/null && command -v zstd >/dev/null || { $(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q qemu-system-x86 zstd; }
	$(BIN)/python -m k3.cli.vm_image install

test: $(STAMP) cc chromium sandbox-deps vm-deps
	$(BIN)/python -m pytest -q --durations=15 tests

bench: $(STAMP) cc
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done

# Rerun the benchmarks and `k3 demo` behind README.md's figures and regenerate the docs' tables from
# their rows, each naming its machine and date (benchmarks/refresh_docs.sh: about 25 min on 2 idle
# cores; refuses to start beside a test run or above a 0.5 load average). DOCS_FIGURES_ARGS="kda mx"
# reruns some steps only; "--quick --root /tmp/k3-docs" checks the pipeline on a copy of the docs.
docs-figures: $(STAMP) cc
	PY=$(BIN)/python K3=$(BIN)/k3 bash benchmarks/refresh_docs.sh $(DOCS_FIGURES_ARGS)

# The CUDA checks and GPU benchmarks for a session lent a GPU (docs/GPU.md): one SKIP line each without CUDA.
# No install step (the device machine has its own CUDA torch and no network): there, pass BIN=<folder of its
# python>; GPU_CHECK_ARGS="--out $OUT" sends the JSON lines where the device tool returns them.
gpu-check:
	$(BIN)/python benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info
