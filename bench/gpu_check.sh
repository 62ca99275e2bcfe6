#!/usr/bin/env bash
# One prepared GPU check, for a machine with an NVIDIA GPU:  bench/gpu_check.sh [OUTDIR [SECONDS]]
# (default OUTDIR bench/results/gpu-<date>, SECONDS 560: the whole script's time budget). Installs nothing from
# the network: the package installs from this checkout without build isolation, and optional
# wheels (jax-triton, liger-kernel, cut-cross-entropy) are taken from ./.whl when that folder exists.
# Writes everything under OUTDIR (or GPU_CHECK_OUT; default bench/results/gpu-<date>): device info, JUnit XML of
# the GPU parity suites, the benchmark JSON/Markdown/PNG, the launch-plan sweep JSON.
# Optional wheels (downloaded on a machine with network access, then copied into ./.whl). jax-triton 0.3.1
# is the release for the H200 image's Triton 3.6 and jax 0.11 (0.4 needs Triton >= 3.7):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_27_x86_64 \
#       -d .whl "jax-triton==0.3.1" absl-py liger-kernel cut-cross-entropy
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${GPU_CHECK_OUT:-bench/results/gpu-$(date +%F)}}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
log() { echo "== $*" | tee -a "$OUTDIR/gpu_check.log"; }
# On exit the JUnit XMLs and the device line go into one archive beside the log and the
# benchmark's and sweep's own files (a handful of files to copy off the machine).
pack() { (cd "$OUTDIR" && ls *.xml device.csv >/dev/null 2>&1 && tar czf gpu_tests.tgz *.xml device.csv \
  && rm -f *.xml device.csv); ls -l "$OUTDIR"; }
trap pack EXIT

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$OUTDIR/device.csv" 2>&1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >> "$OUTDIR/gpu_check.log" 2>&1; then
  # no usable setuptools: run from the checkout, mapping dlm_kernels.kernels by a link
  ln -sfn ../../kernels python/dlm_kernels/kernels
  export PYTHONPATH=$PWD/python:$PWD${PYTHONPATH:+:$PYTHONPATH}
  log "pip install failed; running from the checkout via PYTHONPATH"
fi

# One time budget for the whole script (SECONDS argument or GPU_CHECK_SECONDS, default 560):
# each step gets what is left, minus what the later steps are promised.
DEADLINE=${2:-${GPU_CHECK_SECONDS:-560}}
left() { local t=$(( DEADLINE - SECONDS - $1 )); echo $(( t > 10 ? t : 10 )); }
# GPU_CHECK_STEPS picks steps (a rerun after a partial run), e.g. "parity bench jax".
STEPS=" ${GPU_CHECK_STEPS:-parity bench jax sweep sampling grpo diffusion_gemma suites} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
# what the later steps are promised, in seconds, when they are to run
later() { local s=0 step; for step in "$@"; do want "${step%:*}" && s=$(( s + ${step#*:} )); done; echo $s; }

# Steps in order of what only a GPU can tell, each with its own JUnit XML or JSON (a run cut
# by its timeout writes no XML): real-size parity, the benchmark at the target shape, the
# real jax-triton, the launch-plan sweep, and last the small-shape suites on CUDA tensors
# (the interpreter already runs them on CPU; here they compile one kernel per feature,
# dtype and entropy specialisation).
# JAX_PLATFORMS: the test conftest defaults JAX to the CPU; here jax-triton needs the GPU.
# -n 0: one pytest process on the one GPU (the suite's own -n auto starts 4 workers, and 4
# JAX processes each taking 75 % of the card's memory ran out of it: run of 2026-12-04);
# XLA_PYTHON_CLIENT_PREALLOCATE=false leaves the card to the torch tests of the same process.
gpu_pytest() {  # gpu_pytest SECONDS XML TESTS...
  local t=$1 xml=$2; shift 2
  JAX_PLATFORMS=cuda,cpu TRITON_INTERPRET=0 DLM_TEST_DEVICE=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false \
    timeout "$t" python3 -m pytest -q -n 0 -p no:cacheprovider \
    "$@" --junitxml="$OUTDIR/$xml" 2>&1 | tail -15 | tee -a "$OUTDIR/gpu_check.log"
}

if want parity; then
  log "GPU parity at real sizes (compiled Triton on CUDA tensors, K = 262144, N·K > 2^31) and one row, one answer there"
  t=$(left "$(later bench:150 jax:150 sweep:60 sampling:90 grpo:60 diffusion_gemma:60 suites:100)"); [ "$t" -gt 130 ] && t=130
  gpu_pytest "$t" gpu_tests.xml -k "not jax" tests/token_stats/test_gpu.py "tests/token_stats/test_triton.py::test_row_offsets_past_int32"
fi

if want bench; then
  log "benchmark (target shape first; stops starting cases after the budget)"
  t=$(left "$(later jax:150 sweep:60 sampling:90 grpo:60 diffusion_gemma:60)")  # all that is left when it runs alone (the whole grid)
  # --no-sampling: the denoising step has a step of its own below (all four GPU shapes)
  TRITON_INTERPRET=0 timeout "$t" python3 -m bench --full --no-sampling --reps 8 --budget-s $(( t > 120 ? t - 60 : t / 2 )) --out "$OUTDIR" 2>&1 \
    | tail -60 | tee -a "$OUTDIR/gpu_check.log"
fi

if want jax; then
  log "JAX through jax-triton (skips without a jax-triton wheel in ./.whl)"
  python3 -c "import jax, jax_triton, triton; print('jax', jax.__version__, 'jax-triton',
jax_triton.__version__, 'triton', triton.__version__)" 2>&1 | tail -1 | tee -a "$OUTDIR/gpu_check.log"
  t=$(left "$(later sweep:60 sampling:90 grpo:60 diffusion_gemma:60)"); [ "$t" -gt 150 ] && t=150
  gpu_pytest "$t" gpu_jax_tests.xml "tests/token_stats/test_gpu.py::test_jax_triton_parity" "tests/token_stats/test_gpu.py::TestJaxTritonGpu"
fi

if want sweep; then
  log "launch-plan sweep of the streaming kernels (CE, N = 16384, K = 262144, bf16)"
  t=$(left "$(later sampling:90 grpo:60 diffusion_gemma:60 suites:60)"); [ "$t" -gt 90 ] && t=90
  TRITON_INTERPRET=0 timeout "$t" python3 -m bench.launch_sweep --reps 8 --out "$OUTDIR" 2>&1 \
    | tail -15 | tee -a "$OUTDIR/gpu_check.log"
  # the same with a teacher stream (OPD) at N = 4096, if the time allows
  t=$(left "$(later sampling:90 grpo:60 diffusion_gemma:60 suites:60)")
  if [ "$t" -gt 40 ]; then
    [ "$t" -gt 90 ] && t=90
    log "launch-plan sweep, distillation (two streams), N = 4096"
    TRITON_INTERPRET=0 timeout "$t" python3 -m bench.launch_sweep --teacher --n 4096 --reps 8 \
      --out "$OUTDIR" 2>&1 | tail -15 | tee -a "$OUTDIR/gpu_check.log"
  fi
fi

if want sampling; then
  log "denoising step: the Triton sampler's parity suite on CUDA, then its benchmark (B·L 16384 and 256)"
  # this step's share of the script's time budget (at most 90 s): a third for the tests, the
  # rest for the benchmark, whose GPU shapes are bench/sampling.py's GPU_SHAPES; it writes
  # sampling.json and sampling.md beside the other results and its table goes into the log
  t=$(left "$(later grpo:60 diffusion_gemma:60 suites:60)"); [ "$t" -gt 90 ] && t=90
  tests_s=$(( t / 3 )); bench_s=$(( t - t / 3 ))
  gpu_pytest "$tests_s" gpu_sampling_tests.xml "tests/sampling/test_sampling.py::TestTorchTriton" \
    "tests/sampling/test_sampling.py::test_same_seed_same_tokens_on_every_backend"
  TRITON_INTERPRET=0 timeout "$bench_s" python3 -m bench.sampling \
    --json "$OUTDIR/sampling.json" --md "$OUTDIR/sampling.md" 2>&1 | tail -20 | tee -a "$OUTDIR/gpu_check.log"
fi

if want grpo; then
  log "fused linear GRPO at Liger's published shape (16 x 1024 rows, H 4096, V 128256, bf16): ours, unfused, Liger"
  t=$(left "$(later diffusion_gemma:60 suites:60)"); [ "$t" -gt 90 ] && t=90
  TRITON_INTERPRET=0 timeout "$t" python3 -m bench.linear_head --n 16384 --d 4096 --k 128256 \
    --dtype bfloat16 --frameworks torch --variants ours-grpo,unfused-grpo,liger-grpo --no-scaling \
    --reps 5 --json "$OUTDIR/grpo_linear_head.json" --md "$OUTDIR/grpo_linear_head.md" 2>&1 \
    | tail -12 | tee -a "$OUTDIR/gpu_check.log"
fi

if want diffusion_gemma; then
  # skipped without transformers' DiffusionGemma (transformers 5.23)
  if python3 -c "import transformers.models.diffusion_gemma" >/dev/null 2>&1; then
    log "DiffusionGemma head, dense vs patched: loss fwd+bwd and one denoising step (V 262144, canvas 256, B 1, cap 30, bf16, D 2304 (transformers' config default), 2112, 2816)"
    t=$(left "$(later suites:60)"); [ "$t" -gt 90 ] && t=90
    TRITON_INTERPRET=0 timeout "$t" python3 -m bench.diffusion_gemma --d 2304,2112,2816 --reps 5 \
      --json "$OUTDIR/diffusion_gemma.json" --md "$OUTDIR/diffusion_gemma.md" 2>&1 \
      | tail -30 | tee -a "$OUTDIR/gpu_check.log"
  else
    log "DiffusionGemma head: skipped (transformers with DiffusionGemma, 5.23, not installed)"
  fi
fi

t=$(left 5)
if ! want suites; then
  :
elif [ "$t" -gt 30 ]; then  # left() never answers below 10
  log "GPU parity suites at small awkward shapes and the domain sweep (torch)"
  gpu_pytest "$t" gpu_suite_tests.xml "tests/token_stats/test_triton.py::TestTorchTriton" \
    "tests/objectives/test_triton.py::TestTorchTritonObjectives" \
    "tests/test_domain.py::test_token_stats_over_the_domain[torch-triton]" \
    "tests/test_domain.py::test_objectives_over_the_domain[torch-triton]"
else
  log "GPU parity suites at small shapes: skipped, no time left"
fi
log "done after ${SECONDS} s"
