# rlfabric: the two commands a user needs are `make setup` and `make test` (see README.md).
PY := .venv/bin/python
export OMP_NUM_THREADS ?= 1

.PHONY: setup proto lint test soak bench lock clean help up train ps logs down scale-reward scale-rollout demo \
        demo-multi-turn device-check

help:
	@echo "make setup [PLATFORM=cpu|cuda|ascend]  create .venv with the platform's locked stack (default cpu;"
	@echo "              requirements/constraints-PLATFORM.txt; idempotent)"
	@echo "make device-check  the CUDA paths (trainer bf16/TE, vLLM rollout, NCCL weight sync) on one GPU, < 10 min"
	@echo "make test    lint + the default test suite (what CI runs)"
	@echo "make demo    GRPO that learns, on this machine in under 10 min: warm-up, every service, before/after, charts"
	@echo "make demo-multi-turn  GRPO with a tool (code sandbox + tool server): reward, tool calls and success rise"
	@echo "make up [CONFIG=configs/x.yaml] [REWARD_WORKERS=N] [ROLLOUT_REPLICAS=N] [ARGS='-o k=v ...']"
	@echo "              Redis + every service, detached (rlfabric system up); the default config's tiny model"
	@echo "              and data are made in runs/tiny_cpu first"
	@echo "make train [ARGS='-o k=v ...']                          a run on the system make up started (its config)"
	@echo "make ps | logs [SERVICE=...] | down                    the running system (SYSTEM_DIR=runs/system)"
	@echo "make scale-reward N=3 | scale-rollout N=2              add or drain reward workers / rollout replicas"
	@echo "make up TARGET=k8s [OVERLAY=cpu|cuda|ascend]           apply deploy/k8s"
	@echo "make proto   regenerate the gRPC stubs from protos/"
	@echo "make soak    the slow suites"
	@echo "make bench   run the benchmarks (results in bench/RESULTS.md)"

PLATFORM ?= cpu
setup:
ifeq ($(PLATFORM),cpu)
	@bash deploy/local/setup_cpu.sh
else
	@bash deploy/local/setup_accel.sh $(PLATFORM)
endif

device-check:
	$(PY) -m bench.device_check

DEFAULT_CONFIG := configs/grpo_tiny_cpu.yaml
CONFIG ?= $(DEFAULT_CONFIG)
ARGS ?=
REWARD_WORKERS ?= 1
ROLLOUT_REPLICAS ?= 1
SYSTEM_DIR ?= runs/system
SERVICE ?=
RLF := .venv/bin/rlfabric

# The default config names the tiny model and data of runs/tiny_cpu: `up` makes them once, as `demo` makes its own.
up:
ifeq ($(TARGET),k8s)
	@# make up TARGET=k8s [OVERLAY=cpu|cuda|ascend] [KUBECTL=...]: secrets if missing, then the rendered overlay
	KUBECTL=$(or $(KUBECTL),.venv/bin/kubectl) bash deploy/k8s/secrets.sh
	manifest=$$(mktemp) && trap 'rm -f "$$manifest"' EXIT && \
	  $(or $(KUBECTL),.venv/bin/kubectl) kustomize deploy/k8s/overlays/$(or $(OVERLAY),cpu) > "$$manifest" && \
	  $(or $(KUBECTL),.venv/bin/kubectl) apply -f "$$manifest"
else
ifeq ($(CONFIG),$(DEFAULT_CONFIG))
	bash examples/grpo/tiny_assets.sh
endif
	$(RLF) system up $(CONFIG) --reward-workers $(REWARD_WORKERS) --rollout-replicas $(ROLLOUT_REPLICAS) \
	  --dir $(SYSTEM_DIR) $(ARGS)
endif

train:
	$(RLF) train --system-dir $(SYSTEM_DIR) $(ARGS)

ps:
	$(RLF) system ps --dir $(SYSTEM_DIR)

logs:
	$(RLF) system logs $(SERVICE) --dir $(SYSTEM_DIR)

down:
	$(RLF) system down --dir $(SYSTEM_DIR)

scale-reward:
	@test -n "$(N)" || { echo "usage: make scale-reward N=COUNT"; exit 2; }
	$(RLF) system scale reward $(N) --dir $(SYSTEM_DIR)

scale-rollout:
	@test -n "$(N)" || { echo "usage: make scale-rollout N=COUNT"; exit 2; }
	$(RLF) system scale rollout $(N) --dir $(SYSTEM_DIR)

demo:
	bash examples/grpo/grpo_demo_cpu.sh

demo-multi-turn:
	bash examples/multi_turn/multi_turn_demo_cpu.sh

proto:
	$(PY) -m services.common.protogen

lint:
	$(PY) -m ruff check services tests bench examples cli
	.venv/bin/lint-imports  # the layers of pyproject.toml [tool.importlinter]

test: lint
	$(PY) -m pytest -q --durations=25 tests

soak:
	$(PY) -m pytest -q -m slow tests

bench:
	@for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

lock:
	$(PY) -m pip freeze | grep -vE '^-e|^rlfabric' > requirements/constraints-cpu.txt

clean:
	rm -rf .venv .pytest_cache .ruff_cache .import_linter_cache
