# Two entry points; each does all set-up (venv + install) first.
.PHONY: setup run test

setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/python -m verl_lite.trainer.main_ppo $(ARGS)

test: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider tests
