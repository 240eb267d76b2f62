"""How far an artifact's `hexq eval` perplexity moves with the rounding of its float32 arithmetic alone: every RMSNorm
output of the served family multiplied by (1 + noise x N(0, 1)), for a few seeds, against the unperturbed evaluation.
A tolerance between two devices (scripts/gpu_check.py) below this spread cannot be met by a correct computation.

    python scripts/eval_sensitivity.py ARTIFACT [--windows 4] [--noise 1e-7] [--seeds 1 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# run in a child per seed: the patch is the family's RMSNorm, for every layer, before hexq builds the model
CHILD = """
import importlib, sys, torch
from hexq_cli.main import main
noise, seed, model_type = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
norm = next(cls for name, cls in vars(module).items() if name.endswith("RMSNorm"))
forward, generator = norm.forward, torch.Generator().manual_seed(seed)
def noisy(self, x):
    out = forward(self, x)
    return out * (1 + noise * torch.randn(out.shape, generator=generator).to(out.dtype)) if noise else out
norm.forward = noisy
sys.argv = ["hexq", "eval", *sys.argv[4:]]
main()
"""


def perplexity(artifact: Path, windows: int, noise: float, seed: int, model_type: str, out: Path) -> float:
    done = subprocess.run([sys.executable, "-c", CHILD, str(noise), str(seed), model_type, str(artifact), "-d",
                           "austen", "-n", str(windows), "-L", "256", "--device", "cpu", "--json", str(out)],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"hexq eval failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(out.read_text())["results"][0]["perplexity"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--noise", type=float, default=1e-7)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    model_type = json.loads((args.artifact / "config.json").read_text())["model_type"]
    with tempfile.TemporaryDirectory() as work:
        base = perplexity(args.artifact, args.windows, 0.0, 0, model_type, Path(work) / "base.json")
        print(f"{args.artifact.name}: perplexity {base:.6f} on {args.windows} windows x 256 of austen")
        for seed in args.seeds:
            moved = perplexity(args.artifact, args.windows, args.noise, seed, model_type, Path(work) / f"{seed}.json")
            print(f"  noise {args.noise:g}, seed {seed}: {moved:.6f} (relative change {abs(moved / base - 1):.2e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
