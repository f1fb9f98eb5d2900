#!/usr/bin/env bash
# Everything jmp_lite checks on a GPU machine, into one results folder named
# after the device: bench/results/gpu/<device>/ (or $GPU_RESULTS).
#
#   bash bench/gpu.sh info       # device, compute capability, driver, CUDA, JAX (seconds)
#   bash bench/gpu.sh suite      # the whole test suite, default XLA flags (~7 min on an H100)
#   bash bench/gpu.sh examples   # the examples at their default sizes
#   bash bench/gpu.sh bench1     # the bench's GPU plan, first half of the sections
#   bash bench/gpu.sh bench2     # ... second half
#   bash bench/gpu.sh all        # all of the above in one go (about 30 minutes)
#   bash bench/gpu.sh lease      # what fits one 15-minute lease of a lent machine:
#                                # info, the guard section, the suite without its
#                                # slowest modules, the fp8 section, the guard profile
#
# Each part but `all` fits a 10-minute command; run them one after another
# (each appends to the same folder; `info` first). Every part writes its log
# (and the suite a JUnit XML) there and exits non-zero if what it ran failed.
#
# The project must be installed in the Python that runs this (editable, so
# that subprocesses of the tests and examples import it). On a machine whose
# image has another JAX, install the supported one first:
#   ../shared/gpu/wheels.sh .whl     # here: downloads and splits the wheels
#   bash .whl/install.sh /tmp/p      # there, after copying .whl/c0..c3 to /tmp/p
# (the `device` tool's README says how to carry the parts over in 4 calls).
# Within one 15-minute lease there is no time for that: `lease` runs on the
# image's JAX (0.11.2 in 2026-11, outside the declared range: its failures in
# scans are the known API changes, see bench/results/gpu/NVIDIA-H100/README.md),
# with jmp 0.0.4 carried as a wheel (`pip download jmp==0.0.4 --no-deps`).
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: bench/gpu.sh info|suite|examples|bench1|bench2|all|lease}
case "$part" in info|suite|examples|bench1|bench2|all|lease) ;;
  *) echo "unknown part: $part (info|suite|examples|bench1|bench2|all|lease)" >&2; exit 2 ;;
esac
py=${PYTHON:-python3}

device=$("$py" -c "import jax; print(jax.devices()[0].device_kind)" 2>/dev/null || echo unknown)
slug=$(echo "$device" | tr -cs 'A-Za-z0-9' '-' | sed 's/^-//; s/-$//')
out=${GPU_RESULTS:-bench/results/gpu/$slug}
mkdir -p "$out"
# Default XLA flags on purpose: the guarantees must hold under them.
unset XLA_FLAGS
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several test processes share the GPU
export PYTEST_ADDOPTS="-p no:benchmark ${PYTEST_ADDOPTS:-}"  # an image plugin errors under xdist

run() {  # run NAME COMMAND...: tee into $out/NAME.log, record the exit code
  local name=$1; shift
  echo "== $name: $*" | tee "$out/$name.log"
  local start=$SECONDS
  "$@" 2>&1 | tee -a "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc in $((SECONDS - start)) s" | tee -a "$out/$name.log"
  echo "$name $rc $((SECONDS - start))" >> "$out/status.txt"
  return "$rc"
}

info() {
  run info bash -c "
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv || true
    nvidia-smi | sed -n '1,4p' || true
    $py - <<'EOF'
import jax, flax, optax, platform
print('python', platform.python_version(), '| jax', jax.__version__, '| flax', flax.__version__, '| optax', optax.__version__)
for d in jax.devices():
  print(d, '|', d.device_kind, '| compute capability', getattr(d, 'compute_capability', '?'))
print('backend', jax.default_backend(), '|', jax.extend.backend.get_backend().platform_version)
EOF"
}

suite() {
  run suite "$py" -m pytest -n 12 -q -p no:cacheprovider \
      --junitxml="$out/suite.xml" -o junit_family=xunit1
}

examples() {
  local rc=0
  run example-digits "$py" examples/train_digits.py --out-dir "$out/runs/digits" --no-progress || rc=1
  run example-char-lm "$py" examples/train_char_lm.py --out-dir "$out/runs/char_lm" --no-progress || rc=1
  run example-autocast "$py" examples/autocast_plain_jax.py || rc=1
  run example-localize "$py" examples/localize_overflow.py --out-dir "$out/runs/localize" --no-progress || rc=1
  return $rc
}

bench() {  # bench PART: the GPU plan's sections, split in two
  local sections
  sections=$("$py" bench/run.py --list | awk 'NF {print $1}' | grep -v ':' )
  local n half
  n=$(echo "$sections" | wc -l); half=$(( (n + 1) / 2 ))
  if [ "$1" = 1 ]; then sections=$(echo "$sections" | head -n "$half")
  else sections=$(echo "$sections" | tail -n +"$((half + 1))"); fi
  run "bench$1" "$py" bench/run.py --only "$(echo "$sections" | paste -sd, -)" \
      --out "$out" --name "bench$1"
}

# What one lease of a lent machine (15 minutes of device time, the start
# included) can hold, each step under its own limit so that a slow one cannot
# take the rest. Times measured on an H100 and an H200 (2026-11-26): guard 29 s,
# this suite 194 s at -n 14, fp8 94 s, the profile about 60 s. The guard runs
# first, on a quiet GPU, since it is timed.
lease() {
  local rc=0
  info || rc=1
  run guard timeout 90 "$py" bench/run.py --only guard --out "$out" --name guard || rc=1
  run suite-lease timeout 330 "$py" -m pytest -n 14 -q -p no:cacheprovider \
      --junitxml="$out/suite-lease.xml" -o junit_family=xunit1 \
      --ignore=tests/test_examples.py --ignore=tests/test_readme.py \
      --ignore=tests/test_multihost.py --ignore=tests/test_multihost_checkpoint.py \
      --ignore=tests/test_distributed.py || rc=1
  run fp8 timeout 150 "$py" bench/run.py --only fp8 --out "$out" --name fp8 || rc=1
  run profile-guard timeout 120 "$py" bench/profile_guard.py --out "$out/profile" || rc=1
  return $rc
}

case "$part" in
  lease) lease ;;
  info) info ;;
  suite) suite ;;
  examples) examples ;;
  bench1) bench 1 ;;
  bench2) bench 2 ;;
  all) rc=0; info || rc=1; suite || rc=1; examples || rc=1
       bench 1 || rc=1; bench 2 || rc=1; exit $rc ;;
esac
