"""verl's gsm8k tool and interaction as a user ports them to verl_lite: the verl base classes imported from verl_lite,
verl's scorer replaced by verl_lite's, the rest unchanged (test_verl_scripts.py points the scripts' YAMLs here)."""
