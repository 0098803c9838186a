# Two commands for a new user (see README): `make up` and `make test`. Both set everything up first.
.PHONY: setup demo up test lint format bench bench-all bench-gpu lock client

setup:
	@bash scripts/setup.sh

# The first command: the improvement loop on embedded defaults (vla-rl up --help): a weak base, then
# 3 rounds of fleet -> round -> live swap on PickCube with 4 simulated robots; exits with the per-round
# table. Workdir runs/up (running it again resumes). More flags: make up UP_FLAGS="--rounds 6".
UP_FLAGS ?=
up: setup
	.venv/bin/vla-rl up $(UP_FLAGS)

# A smaller look: demos -> store -> SFT -> registry -> eval, once (vla-rl demo --help).
demo: setup
	.venv/bin/vla-rl demo

# The suite runs in TEST_WORKERS processes (pytest-xdist), whole files per worker so each module's fixtures
# are built once; most tests wait on servers and subprocesses, so 2 workers on 2 cores halve the wall time.
# TEST_WORKERS=0 runs everything in this one process (e.g. to use pdb).
TEST_WORKERS ?= 2
test: setup
	.venv/bin/python -m ruff check .
	.venv/bin/python -m ruff format --check .
	.venv/bin/python -m pytest -m "not slow" -q -n $(TEST_WORKERS) --dist loadfile --durations=30

lint: setup
	.venv/bin/python -m ruff check . && .venv/bin/python -m ruff format --check .

format: setup
	.venv/bin/python -m ruff check --fix . && .venv/bin/python -m ruff format .

# Regenerate requirements/lock.txt (pip freeze of pyproject.toml + dev resolved afresh; see the script's header).
lock:
	bash scripts/lock.sh

# The robot-side wheel, vla-rl-client (packages/vla-rl-client: numpy, grpcio, protobuf, Pillow only) -> dist/.
client: setup
	.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w dist/ packages/vla-rl-client

# Benchmarks (bench/*.py; each one's --help says what it measures). Both targets print each benchmark's table.
#   make bench       a quick subset with short settings: every part of the system once (simulators, episode
#                    store, fleet collector, inference, serving, SFT), ~5-7 min on 2 busy cores. A smoke run:
#                    its numbers are not comparable, so it writes to $(BENCH_QUICK)/, not bench/results/.
#   make bench-all   every CPU benchmark at the settings of its numbers in bench/results/ (and the README),
#                    overwriting them: many hours on 2 cores (rl, ppo_check, sft, qam_check dominate).
#   make bench-gpu   bench/gpu_check.py and bench/gpu_vla.py (LeRobot's SmolVLA and pi0 at their published
#                    sizes, our FlowVLA; eager / compiled / CUDA graphs, K = 10 vs 1-2) on a CUDA machine
#                    (writes bench/results/gpu_check.json and gpu_vla.json).
# Not run by either: bench/plot_curves.py (plots curve.json files; see its --help). `python -m bench.<name>`
# from the repo root finds the bench package even where the editable install predates it.
BENCH_QUICK := runs/bench-quick

bench: setup
	.venv/bin/python -m bench.sim_speed --steps 50 --image-size 64 --out $(BENCH_QUICK)/sim_speed.json
	.venv/bin/python -m bench.store_speed --frames 256 --seconds 5 --out $(BENCH_QUICK)/store_speed.json
	.venv/bin/python -m bench.collect_stages --frames 64 --no-codecs --out $(BENCH_QUICK)/collect_stages.json
	.venv/bin/python -m bench.collect --robots 2 --seconds 5 --capacity-seconds 0 --lockstep-seconds 0 \
		--lerobot-frames 0 --images smooth --out $(BENCH_QUICK)/collect.json
	.venv/bin/python -m bench.expert_success --episodes 2 --noise 0 --out $(BENCH_QUICK)/expert_success.json
	.venv/bin/python -m bench.inference --threads 1 --repeats 3 --out $(BENCH_QUICK)/inference.json
	.venv/bin/python -m bench.serve --duration 2 --clients 1 --overhead-requests 3 --out $(BENCH_QUICK)/serve.json
	.venv/bin/python -m bench.sft --settings push-state --seeds 0 --demos 5 --steps 50 --episodes 2 \
		--work $(BENCH_QUICK)/sft --out $(BENCH_QUICK)/sft.json

bench-all: setup
	.venv/bin/python -m bench.sim_speed
	.venv/bin/python -m bench.store_speed
	nice .venv/bin/python -m bench.collect_stages --frames 1024
	nice .venv/bin/python -m bench.collect
	.venv/bin/python -m bench.expert_success
	.venv/bin/python -m bench.inference --threads 1 --repeats 15 --device cpu
	.venv/bin/python -m bench.compile --models flowvla-camera smolvla --device cpu
	.venv/bin/python -m bench.compile --models flowvla-state --device cpu --out bench/results/compile_state_only.json
	nice -n 19 .venv/bin/python -m bench.serve --duration 15
	.venv/bin/python -m bench.serve_vla --duration 60 --grace 300
	.venv/bin/python -m bench.sft --settings push-state pick-state
	.venv/bin/python -m bench.sft --settings push-rgb --work runs/bench_sft_rgb --out bench/results/sft_rgb.json
	.venv/bin/python -m bench.latency --settings push-state --episodes 20 --out runs/bench_latency/push.json
	.venv/bin/python -m bench.latency --settings pick-state --episodes 10 --latencies 0 300 100 \
		--out runs/bench_latency/pick.json
	.venv/bin/python -m bench.latency --merge runs/bench_latency/push.json runs/bench_latency/pick.json
	.venv/bin/python -m bench.gate
	.venv/bin/python -m bench.ppo_check
	nice -n 19 .venv/bin/python -m bench.qam_check --label lam100 --sft-steps 1500 --sft-d-model 64 \
		--sft-expert-layers 2 --inv-temp 100 --offline-steps 200 --env-steps 4000 --actor-lr 1e-4
	.venv/bin/python -m bench.rl --seeds 0
# re-scores the rl run above on 300 further episodes (bench/results/rl_reeval.json)
	.venv/bin/python -m bench.rl_reeval --work runs/bench_rl --task maniskill/PickCube-v1 --seeds 0 \
		--runs awr recap qam qam-o2o flow-noise flow-sde flow-sde-all

bench-gpu: setup
	.venv/bin/python -m bench.gpu_check --device cuda --out bench/results/gpu_check.json
	.venv/bin/python -m bench.gpu_vla --device cuda --out bench/results/gpu_vla.json
