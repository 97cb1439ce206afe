"""Kill a run at random moments and resume it each time: does it end as the run that never stopped?

    python tests/bench_kill_resume.py [seed]

The built-in task for 10 steps with --save_total_limit 2 --save_interval 1, one process. Each try waits for the
first step it logs, then SIGKILLs it at a random moment of the next 2.5 s (steps, saves, deletions), and starts
`--resume auto` again, until a try ends by itself. It prints the final weights and logs against the straight run's
(bitwise) and the most checkpoint folders seen on disk, polled every 2 ms. pytest does not collect this file.
"""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from safetensors.torch import load_file

from helpers import TRAIN, env1

FLAGS = ["--batch_size", "16", "--num_generations", "8", "--max_gen_len", "32", "--sft_warmup_steps", "0",
         "--eval_interval", "0", "--max_steps", "10"]
TIMING = {"step_time", "generate_time", "tokens_per_s", "peak_mem_gib"}


def logged(path):
    """The log's records without the measured times."""
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in open(path)]


def line_count(path):
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for _ in f)


def main(seed):
    root = tempfile.mkdtemp(prefix="kill_resume_")
    straight, killed = os.path.join(root, "straight"), os.path.join(root, "killed")
    subprocess.run([sys.executable, TRAIN, *FLAGS, "--save_dir", straight], env=env1(), check=True,
                   capture_output=True)
    seen = {"whole": 0, "folders": 0}
    done = threading.Event()

    def watch():
        while not done.is_set():
            names = [n for n in os.listdir(killed) if n.startswith("checkpoint-")] if os.path.isdir(killed) else []
            whole = [n for n in names if re.fullmatch(r"checkpoint-\d+", n)]
            seen["whole"] = max(seen["whole"], len(whole))
            seen["folders"] = max(seen["folders"], len(names))
            time.sleep(0.002)
    threading.Thread(target=watch, daemon=True).start()
    rng = random.Random(seed)
    metrics = os.path.join(killed, "metrics.jsonl")
    kills = 0
    while True:
        before = line_count(metrics)
        p = subprocess.Popen([sys.executable, TRAIN, *FLAGS, "--save_total_limit", "2", "--save_interval", "1",
                              "--resume", "auto", "--save_dir", killed], env=env1(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        while p.poll() is None and line_count(metrics) <= before:
            time.sleep(0.01)
        try:
            _, err = p.communicate(timeout=rng.uniform(0.0, 2.5))
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.communicate()
            kills += 1
            continue
        assert p.returncode == 0, err[-3000:]
        break
    done.set()
    wa = load_file(os.path.join(straight, "final", "model.safetensors"))
    wb = load_file(os.path.join(killed, "final", "model.safetensors"))
    left = sorted(n for n in os.listdir(killed) if n.startswith("checkpoint-"))
    print(f"kills: {kills}; final weights bitwise equal: {all(wa[k].equal(wb[k]) for k in wa)}; logs equal: "
          f"{logged(os.path.join(straight, 'metrics.jsonl')) == logged(metrics)}; most whole checkpoints seen: "
          f"{seen['whole']}; most checkpoint folders (being written or deleted too): {seen['folders']}; "
          f"left: {left}")
    shutil.rmtree(root)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
