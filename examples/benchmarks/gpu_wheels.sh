#!/usr/bin/env bash
# The pure-Python wheels that the lent GPU machines' image lacks, for gpu_check.py (whose pip installs
# them offline into a temporary folder on its steps' PYTHONPATH there: the image's environment stays
# as it is, and that machine reaches no index).
# The main job (`zinf fit`) needs jsonargparse with its signature helpers; the image has PyYAML and
# typing-extensions. Run here, then carry examples/benchmarks/gpu_wheels with the tree
# (docs/tests.md, "On a GPU"). The versions are this venv's, or the newest when it lacks them.
#
# With --deepspeed it adds DeepSpeed for offload_gpu.py's ZeRO-Offload arm: its sdist built here into
# a pure-Python wheel (DS_BUILD_OPS=0: no op is compiled here; its CPU Adam is JIT-built there with
# that machine's compiler on first use), and the binary wheels of its dependencies for CPython 3.12
# on x86_64 Linux, except numpy, packaging, tqdm and torch, which the image has (carrying them would
# shadow the image's own). About 10 MB.
set -euo pipefail
deepspeed=0
[ "${1:-}" = "--deepspeed" ] && deepspeed=1
cd "$(dirname "$0")"
rm -rf gpu_wheels && mkdir gpu_wheels
pin() {  # NAME -> NAME==VERSION as installed here, else NAME
    local version
    version=$(python3 -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p')
    if [ -n "$version" ]; then echo "$1==$version"; else echo "$1"; fi
}
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --dest gpu_wheels \
    "$(pin jsonargparse)" "$(pin docstring-parser)" "$(pin typeshed-client)"
if [ "$deepspeed" = 1 ]; then
    python3 -m pip download --quiet --no-deps --no-binary=:all: --dest gpu_wheels "$(pin deepspeed)"
    DS_BUILD_OPS=0 python3 -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir gpu_wheels gpu_wheels/deepspeed-*.tar.gz
    rm gpu_wheels/deepspeed-*.tar.gz
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        --dest gpu_wheels einops hjson msgpack ninja psutil py-cpuinfo pydantic pydantic-core annotated-types \
        typing-inspection nvidia-ml-py
fi
du -sh gpu_wheels && ls gpu_wheels
