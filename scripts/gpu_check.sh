#!/usr/bin/env bash
# Every hexq command on CUDA against the CPU's numbers (scripts/gpu_check.py says what and to which tolerance), then
# the GPU tests (pytest -m gpu). For a GPU machine with torch and transformers but no hexq install: the repository
# goes on PYTHONPATH, the CLI under its installed name (hexq_cli), and wheels in .whl/ (packages the machine lacks,
# e.g. compressed-tensors, loguru, pydantic for the export's check) into a temporary site folder. `hexq eval` reads its
# held-out texts from HEXQ_CORPORA: point it at a copy of the corpora folder where the shared one is not beside the
# repository.
#   scripts/gpu_check.sh                  # reference model + a 2-layer Qwen3-30B-A3B-shaped checkpoint, ~7 min
#   scripts/gpu_check.sh --profile        # and that checkpoint's calibration under torch's profiler, ~1 min more
#   DEVICE=cpu scripts/gpu_check.sh --size tiny [--profile]   # the script itself, on any machine
set -euo pipefail
cd "$(dirname "$0")/.."
python=python3  # the machine's Python; the project's environment (make setup) where there is one
[ -x .venv/bin/python ] && python=.venv/bin/python
site="$(mktemp -d)"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
fi
"$python" -c "import hexq_cli" 2>/dev/null || ln -s "$PWD/cli" "$site/hexq_cli"
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" scripts/gpu_check.py "$@"
