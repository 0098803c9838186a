# Two commands for a new user (see README): `make demo` and `make test`. Both set everything up first.
.PHONY: setup demo test lint format bench lock client

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/vla-rl demo

test: setup
	.venv/bin/python -m ruff check .
	.venv/bin/python -m ruff format --check .
	.venv/bin/python -m pytest -m "not slow" -q

lint: setup
	.venv/bin/python -m ruff check . && .venv/bin/python -m ruff format --check .

format: setup
	.venv/bin/python -m ruff check --fix . && .venv/bin/python -m ruff format .

# The slim robot-side wheel, vla-rl-client (numpy, grpcio, protobuf, Pillow only): see server/__init__.py.
client: setup
	.venv/bin/python -m scripts.build_client --out dist/

bench: setup
	.venv/bin/python bench/sim_speed.py
	.venv/bin/python bench/store_speed.py
