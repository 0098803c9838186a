#!/usr/bin/env bash
# Issue 20 target 1 on a borrowed GPU machine (one H200, 16 cores): an online algorithm (Flow-SDE PPO by
# default, or awr-pi) on ManiSkill PickCube (state), several training seeds at once, each with its own
# simulated robots, under one deadline.
#
# Before (here):  python -m bench.rl ... --train-only (the seeds' demos), then
#                 python scripts/device_bundle.py --work runs/pc --out .carry
#                 and the Vulkan loader debs SAPIEN needs even with no renderer (it builds render materials):
#                 mkdir -p .gl && (cd .gl && apt-get download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 \
#                   libglx0 libgles2)   (amd64; see the device tool's notes)
# There:          bash scripts/device_ppo.sh          (carry .carry and .gl; results land in $OUT)
# After (here):   unpack $OUT/seedN.tgz at the repo root and run bench.rl without --train-only to evaluate
#                 the SFT bases and the PPO policies on held-out episodes (docs/benchmarks.md).
#
# Knobs (environment): ALGO (flow-sde, flow-noise, flow-sde-all or awr-pi), SEEDS, BUDGET (seconds from
# the start after which no training iteration starts), NUM_ENVS (robots per seed), ENV_STEPS, SFT_STEPS,
# ROLLOUTS (the base's fleet episodes in the offline store; awr-pi's recipe had 100),
# TAG, PYTHON; PPO: ROLLOUT_STEPS, ACTOR_LR; awr-pi (preset pickcube-awr-pi): EPISODES (per iteration),
# AWR_STEPS (updates per iteration).
set -u
T0=$(date +%s)
ALGO=${ALGO:-flow-sde}
SEEDS=${SEEDS:-"0 1 2"}
BUDGET=${BUDGET:-470}
NUM_ENVS=${NUM_ENVS:-5}
ROLLOUT_STEPS=${ROLLOUT_STEPS:-1000}
ENV_STEPS=${ENV_STEPS:-100000}
SFT_STEPS=${SFT_STEPS:-1500}
ROLLOUTS=${ROLLOUTS:-0}
ACTOR_LR=${ACTOR_LR:-3e-6}
EPISODES=${EPISODES:-30}
AWR_STEPS=${AWR_STEPS:-500}
TAG=${TAG:-dev}
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/device-out}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT" "$SITE"
export PYTHONUNBUFFERED=1 SAPIEN_NO_DISPLAY=1
# The GPU's Vulkan driver behind the loader from .gl ("failed to find a rendering device" without them).
ICD=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -e "$ICD" ]; then
  for f in .gl/*.deb; do [ -e "$f" ] && dpkg -x "$f" /; done
  ldconfig
  export VK_DRIVER_FILES="$ICD" VK_ICD_FILENAMES="$ICD"
fi
tar -C "$SITE" -xJf .carry/site.tar.xz 2>/dev/null ||
  "$PYTHON" -c "import sys, tarfile; tarfile.open('.carry/site.tar.xz').extractall(sys.argv[1], filter='tar')" "$SITE" ||
  { echo "cannot unpack .carry/site.tar.xz"; exit 1; }
export PYTHONPATH="$SITE:$PWD" LD_LIBRARY_PATH="$SITE/xlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
mkdir -p runs && rm -rf runs/pc && cp -r .carry/work runs/pc
echo "unpacked in $(($(date +%s) - T0)) s; $(nproc) cores"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"

# Smoke: the simulator steps here and torch sees the GPU (seconds; a failure shows before the long part).
"$PYTHON" - <<'EOF' || { echo "smoke test failed"; exit 1; }
import time, numpy as np, torch
t = time.time()
from sim.registry import make_env
env = make_env(task="maniskill/PickCube-v1", obs="state")
env.reset(seed=0)
for _ in range(50):
    env.step(np.zeros(env.spec.action_dim, dtype=np.float32))
print(f"smoke: PickCube 50 steps ok ({time.time() - t:.1f} s with imports), cuda={torch.cuda.is_available()}")
EOF

if [ "$ALGO" = awr-pi ]; then
  KNOBS=(--awr-pi-preset pickcube-awr-pi --awr-pi "{\"num_envs\": $NUM_ENVS, \"env_steps\": $ENV_STEPS, \"episodes_per_iteration\": $EPISODES, \"steps_per_iteration\": $AWR_STEPS}")
else
  KNOBS=(--ppo "{\"num_envs\": $NUM_ENVS, \"rollout_steps\": $ROLLOUT_STEPS, \"actor_lr\": $ACTOR_LR, \"checkpoint_every\": 4}")
fi
for s in $SEEDS; do
  "$PYTHON" scripts/device_train.py --site "$SITE" --deadline $((T0 + BUDGET)) -- \
    --algos "$ALGO" --seeds "$s" --rollouts "$ROLLOUTS" --train-only --tag "$TAG" --env-steps "$ENV_STEPS" \
    --sft-steps "$SFT_STEPS" --work runs/pc --no-progress "${KNOBS[@]}" >"$OUT/seed$s.log" 2>&1 &
done
wait
echo "trained in $(($(date +%s) - T0)) s"

# One archive per seed: its SFT base and trained policy (the last checkpoint, or the newest iteration saved
# if the run was cut off), the run's record and curve.
for s in $SEEDS; do
  d=runs/pc/seed$s
  files=("$d/sft.json" "$d/sft/checkpoints/last")
  for f in "$d/$ALGO-$TAG.train.json" "$d/$ALGO-$TAG/curve.json" "$d/$ALGO-$TAG/checkpoints/last"; do
    [ -e "$f" ] && files+=("$f")
  done
  if [ ! -e "$d/$ALGO-$TAG/checkpoints/last" ]; then
    newest=$(ls -d "$d/$ALGO-$TAG/checkpoints/iter_"* 2>/dev/null | tail -1)
    [ -n "$newest" ] && files+=("$newest")
  fi
  tar -czf "$OUT/seed$s.tgz" "${files[@]}"
  tail -3 "$OUT/seed$s.log"
done
ls -la "$OUT"
echo "done in $(($(date +%s) - T0)) s"
