#!/usr/bin/env bash
# Issue 12's GPU checks in one command, sized for one call of a 15-minute device lease
# (under 10 minutes): build the native extension there, the GPU tests, the ABI check,
# bench_gpu (4 and 16 GB) and the training scenario on the GPU (the rest of the time);
# GPU_CHECK_STEPS="slowdown" adds issue 13's bench_slowdown with the training loop on the
# GPU, when 80 s are left. From a checkout, with the device tool (docs/benchmarks.md,
# "On a GPU"):
#
#   make gpu-wheels      # once per checkout: zstandard's and fastjsonschema's wheels for
#                        # the GPU image's Python (3.12), in .whl/
#   run(command="SNAPCORE_COMMIT=<git rev-parse HEAD> bash benchmarks/gpu_check.sh",
#       carry=[".whl"], timeout_s=600)
#
# Results in $OUT (the device tool brings back 8 files at most): summary.txt (versions,
# build, ABI check, each step's exit status and time), pytest-gpu.txt, gpu.json,
# training.json (the harness's documents: copy the JSON into
# docs/figures/ and run `python -m benchmarks docs docs/figures`), and slowdown.json
# (as docs/figures/gpu/slowdown.json: docs/figures/slowdown.json is the CPU run). Each
# step has its share of the time and the script goes on after a failed step.
set -uo pipefail
OUT=${OUT:-${1:-/tmp/gpu-check}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
end=$((SECONDS + ${GPU_CHECK_BUDGET_S:-560}))
# the training scenario's options: the gpu size (64 x 1024 tokens a step, activations
# recomputed: about a second a step), one round of 20 timed steps per mode (a second
# call on the warm machine, GPU_CHECK_STEPS=training, can run more rounds)
TRAINING_OPTS=${TRAINING_OPTS:---rounds 1 --steps 20 --quiet-wait 0}
summary="$OUT/summary.txt"
say() { echo "$*" | tee -a "$summary"; }
# at most $1 seconds, and never past the end of the budget (10 s kept for the summary)
limit() { local l=$((end - SECONDS - 10)); echo $(($1 < l ? $1 : (l > 1 ? l : 1))); }

say "gpu_check $(date -u +%FT%TZ), commit ${SNAPCORE_COMMIT:-?}"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv 2>&1 | tee -a "$summary"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >>"$summary" 2>&1 && export PYTHONPATH=/tmp/site
fi
python3 -c "import zstandard, fastjsonschema" 2>/dev/null ||
    say "zstandard or fastjsonschema is missing: run 'make gpu-wheels' and carry .whl"

say "compiler: $(c++ --version 2>&1 | head -1); CXXFLAGS='${CXXFLAGS:-}' LDFLAGS='${LDFLAGS:-}'"
t=$SECONDS
build() { CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps -e . "$@"; }
if build >"$OUT/build.log" 2>&1; then
    rm -f "$OUT/build.log"
    say "build: ok in $((SECONDS - t)) s"
else
    # another compiler may warn where CI's does not: report the warnings, build without -Werror
    say "build with -Werror FAILED in $((SECONDS - t)) s:"
    grep -E "error|warning" "$OUT/build.log" | head -40 | tee -a "$summary"
    t=$SECONDS
    if ! build -C cmake.define.SNAPCORE_WERROR=OFF >"$OUT/build.log" 2>&1; then
        say "build without -Werror FAILED in $((SECONDS - t)) s:"
        tail -60 "$OUT/build.log" | tee -a "$summary"
        exit 1
    fi
    say "build without -Werror: ok in $((SECONDS - t)) s"
fi
python3 -c "import torch, snapcore._native as n; print('torch', torch.__version__, 'CUDA',
torch.version.cuda, '| snapcore CUDA:', n.cuda_status())" 2>&1 | tee -a "$summary"
python3 benchmarks/abi.py 2>&1 | tee -a "$summary"
python3 -c "import snapcore._native as n; print('GPU 0 NUMA node:', n.cuda_device_numa_node(0))" \
    2>&1 | tail -3 | tee -a "$summary"

# GPU_CHECK_STEPS picks the steps (a second call on the same warm machine reruns one:
# the build is incremental there); each step's PNGs are dropped, since the JSON redraws
# them (`python -m benchmarks plot`) and the tool brings back 8 files at most.
steps=" ${GPU_CHECK_STEPS:-pytest gpu training} "
has() { [[ $steps == *" $1 "* ]]; }
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 60)

if has pytest; then
    t=$SECONDS
    timeout "$(limit 150)" python3 -m pytest -m gpu tests/gpu tests/unit/test_native.py -q -rs \
        "${per_test[@]}" --durations=8 -p no:cacheprovider >"$OUT/pytest-gpu.txt" 2>&1
    say "pytest -m gpu: exit $? in $((SECONDS - t)) s: $(tail -1 "$OUT/pytest-gpu.txt")"
fi

if has gpu; then
    t=$SECONDS
    # restores as the library makes them (judged) and with the ring kept between them
    # (an experiment); h2d.last_profile says where each restore's time went
    timeout "$(limit 150)" python3 -m benchmarks run gpu --out "$OUT" >>"$summary" 2>&1
    say "benchmarks run gpu: exit $? in $((SECONDS - t)) s"
    rm -f "$OUT"/*.png
fi

if has training; then
    t=$SECONDS
    slowdown_s=0
    has slowdown && slowdown_s=110 # kept for bench_slowdown
    timeout "$(limit $((end - SECONDS - slowdown_s)))" python3 -m benchmarks run training \
        --out "$OUT" --opts "training=$TRAINING_OPTS" >>"$summary" 2>&1
    say "benchmarks run training: exit $? in $((SECONDS - t)) s"
    rm -f "$OUT"/*.png
fi

# issue 13: does sending to a partner slow a training loop that waits on its GPU?
if has slowdown; then
    t=$SECONDS
    if ((end - SECONDS > 80)); then
        timeout "$(limit 200)" python3 -m benchmarks run slowdown --out "$OUT" \
            --opts "slowdown=--device cuda --seconds 25" >>"$summary" 2>&1
        say "benchmarks run slowdown: exit $? in $((SECONDS - t)) s"
        rm -f "$OUT"/*.png
    else
        say "benchmarks run slowdown: not run, $((end - SECONDS)) s left"
    fi
fi
ls -la "$OUT" >>"$summary"
