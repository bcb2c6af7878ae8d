#!/usr/bin/env bash
# The pure-Python wheels that the lent GPU machines' image lacks, for gpu_check.py (whose pip installs
# them offline into a temporary folder on its steps' PYTHONPATH there: the image's environment stays
# as it is, and that machine reaches no index).
# The main job (`zinf fit`) needs jsonargparse with its signature helpers; the image has PyYAML and
# typing-extensions. Run here, then carry examples/benchmarks/gpu_wheels with the tree
# (docs/tests.md, "On a GPU"). The versions are this venv's, or the newest when it lacks them.
set -euo pipefail
cd "$(dirname "$0")"
rm -rf gpu_wheels && mkdir gpu_wheels
pin() {  # NAME -> NAME==VERSION as installed here, else NAME
    local version
    version=$(python3 -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p')
    if [ -n "$version" ]; then echo "$1==$version"; else echo "$1"; fi
}
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --dest gpu_wheels \
    "$(pin jsonargparse)" "$(pin docstring-parser)" "$(pin typeshed-client)"
du -sh gpu_wheels && ls gpu_wheels
