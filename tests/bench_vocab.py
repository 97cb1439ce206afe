"""Peak memory of a GRPO step that does not grow with the vocabulary (a script: pytest does not collect it).

    python tests/bench_vocab.py                       # this trainer at V = 151,936 (Qwen's) and 2V
    python tests/bench_vocab.py -- --logp_chunk_size 1024     # extra trainer flags (here: the old default)
    python tests/bench_vocab.py -- --max_gen_len 16 --max_steps 1    # a quick dry run of the script itself

A tiny Qwen2 (hidden 64, 2 layers, tied embeddings) with a V-token vocabulary, built in-process and saved
(bench_step.build); 2 prompts x 8 completions x 64 new tokens, beta 0.04, 2 steps, fp32, on
tests/data/gsm8k_sample.jsonl. Each run is its own process, so its peak resident memory (ru_maxrss) is its
own. Doubling V adds V x 64 parameters; each costs 4 bytes of weight, 4 of gradient, 8 of AdamW state and 4
of the reference copy (a tied head stays fp32): the step's peak should grow by that and little more. When
`trl` is importable, TRL's GRPOTrainer runs the V model on the same data and batch (fp32, its default
gradient checkpointing), for comparison.
"""
import json
import os
import resource
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
V, H = 151_936, 64
BATCH = ["--batch_size", "2", "--num_generations", "8", "--max_gen_len", "64", "--beta", "0.04",
         "--max_steps", "2", "--eval_interval", "0", "--dtype", "float32", "--learning_rate", "1e-6"]


def child(who, model_dir, extra):
    """One run in this process; prints a RESULT line."""
    import bench_step
    tmp = tempfile.TemporaryDirectory()   # removed when this process ends (a run leaves GBs)
    save_dir = tmp.name
    if who == "ours":
        import train_grpo as tg
        tg.main(["--model_name_or_path", model_dir, "--dataset", bench_step.DATA, *BATCH, "--save_dir", save_dir,
                 *extra])
        steps = [json.loads(line) for line in open(os.path.join(save_dir, "metrics.jsonl"))]
        s_per_step = sum(r["step_time"] for r in steps) / len(steps)
    else:
        class A:
            prompts, generations, new_tokens, steps = 2, 8, 64, 2
        s_per_step = bench_step.trl(model_dir, save_dir, A)["s_per_step"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # MiB
    print("RESULT " + json.dumps({"who": who, "peak_rss_mib": round(peak), "s_per_step": round(s_per_step, 2)}))


def run(who, model_dir, extra):
    out = subprocess.run([sys.executable, __file__, "--child", who, model_dir, "--", *extra], capture_output=True,
                         text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(lines[0][len("RESULT "):])


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    if argv and argv[0] == "--child":
        return child(argv[1], argv[2], extra)
    import bench_step
    import train_grpo as tg
    tmp = tempfile.TemporaryDirectory()   # removed when this process ends (a run leaves GBs)
    work = tmp.name
    results = {}
    for vocab in (V, 2 * V):
        path = os.path.join(work, f"v{vocab}")
        bench_step.build(path, small=True, vocab_size=vocab)
        results[vocab] = run("ours", path, extra)
        chunk = (f"{extra[extra.index('--logp_chunk_size') + 1]} tokens" if "--logp_chunk_size" in extra
                 else f"{tg.auto_chunk_tokens(vocab)} tokens (auto)")
        print(f"V = {vocab:,}: peak RSS {results[vocab]['peak_rss_mib']:,} MiB, {results[vocab]['s_per_step']} s/step, "
              f"logits chunk: {chunk}", flush=True)
    extra_params = V * H                                   # the tied embedding/head rows that doubling V adds
    allowed = extra_params * (4 + 4 + 8 + 4) / 2**20     # weight + grad + AdamW + fp32 reference, MiB
    grew = results[2 * V]["peak_rss_mib"] - results[V]["peak_rss_mib"]
    bound = allowed + 0.1 * results[V]["peak_rss_mib"]
    print(f"2V - V: peak grew {grew:,} MiB; weights, gradients, AdamW state and reference of the extra rows: "
          f"{allowed:,.0f} MiB; bound (that + 10% of V's peak): {bound:,.0f} MiB -> "
          f"{'within' if grew <= bound else 'OVER'}")
    try:
        import trl  # noqa: F401
    except ImportError:
        print("trl is not installed: no comparison")
        return
    theirs = run("trl", os.path.join(work, f"v{V}"), [])
    print(f"TRL GRPOTrainer, V = {V:,}: peak RSS {theirs['peak_rss_mib']:,} MiB, {theirs['s_per_step']} s/step; "
          f"ours / TRL's peak: {results[V]['peak_rss_mib'] / theirs['peak_rss_mib']:.2f}")


if __name__ == "__main__":
    main()
