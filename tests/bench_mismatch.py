"""How far the sampler is from the trainer: the mismatch metrics of one GRPO step, per compute dtype, KV cache and
sampling setting (a script: pytest does not collect it).

    python tests/bench_mismatch.py                         # the built-in tiny model (random init)
    python tests/bench_mismatch.py path/to/SmolLM2-135M-Instruct.Q4_1.gguf     # a real model, compare_numbers

Each row is one grpo_step from the same starting weights (learning rate 0: nothing moves between rows) and
prints the five metrics every step logs: |trainer's old log-prob - sampler's log-prob| (mean, max over the masked
tokens) and the importance ratio rho = exp(difference) (min, mean, max). The "fp32 lm_head" rows set
--cast_lm_head_to_fp32 1. BENCH_ONLY=text runs only the rows whose label contains text.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_grpo as tg  # noqa: E402

SETTINGS = [  # (label, flags)
    ("float32, dynamic cache", []),
    ("float32, static cache", ["--rollout_cache", "static"]),
    ("bfloat16, dynamic cache", ["--dtype", "bfloat16"]),
    ("bfloat16, static cache", ["--dtype", "bfloat16", "--rollout_cache", "static"]),
    ("float16, dynamic cache", ["--dtype", "float16"]),
    ("float16, static cache", ["--dtype", "float16", "--rollout_cache", "static"]),
    ("float32, top_p 0.7", ["--top_p", "0.7"]),
    ("bfloat16, top_p 0.7", ["--dtype", "bfloat16", "--top_p", "0.7"]),
    ("bfloat16, dynamic cache, fp32 lm_head", ["--dtype", "bfloat16", "--cast_lm_head_to_fp32", "1"]),
    ("bfloat16, static cache, fp32 lm_head", ["--dtype", "bfloat16", "--rollout_cache", "static",
                                              "--cast_lm_head_to_fp32", "1"]),
    ("float16, dynamic cache, fp32 lm_head", ["--dtype", "float16", "--cast_lm_head_to_fp32", "1"]),
]
ONLY = os.environ.get("BENCH_ONLY")  # e.g. BENCH_ONLY=bfloat16: the rows whose label holds it


def main():
    gguf = sys.argv[1] if len(sys.argv) > 1 else ""
    base = (["--model_name_or_path", gguf, "--dataset", "compare_numbers", "--max_gen_len", "8"] if gguf else
            ["--max_gen_len", "16"])
    base += ["--batch_size", "4", "--num_generations", "8", "--learning_rate", "1e-30", "--eval_interval", "0"]
    args = tg.parse_args(base)
    torch.manual_seed(0)
    model, tok = tg.load_model_and_tokenizer(args, torch.device("cpu"))
    train_rows, _, reward_fns, weights, _ = tg.load_task(args, tok, 1)
    print(f"model: {gguf or 'built-in tiny model'}; {args.batch_size} prompts x {args.num_generations}, "
          f"{args.max_gen_len} new tokens, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"| setting | sampler_logp_diff_mean | sampler_logp_diff_max | is_ratio_min | is_ratio_mean | "
          f"is_ratio_max | s |\n|---|---|---|---|---|---|---|")
    for label, flags in SETTINGS:
        if ONLY and ONLY not in label:
            continue
        args = tg.parse_args(base + flags)
        # the same weights in every row; the fp32 head is the same module with an fp32 forward
        tg.cast_lm_head_to_fp32(model) if args.cast_lm_head_to_fp32 else plain_head(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        constant = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        run = tg.Trainer(model, None, optimizer, constant, tg.loss_scaler(args.dtype, "cpu"), tok, reward_fns,
                         weights, 1, "cpu")
        torch.manual_seed(1)
        t0 = time.time()
        r = tg.grpo_step(args, run, train_rows[:args.batch_size], tg.TrainState())
        print(f"| {label} | {r['sampler_logp_diff_mean']:.2e} | {r['sampler_logp_diff_max']:.2e} | "
              f"{r['is_ratio_min']:.4f} | {r['is_ratio_mean']:.4f} | {r['is_ratio_max']:.4f} | "
              f"{time.time() - t0:.0f} |", flush=True)


def plain_head(model):
    head = model.get_output_embeddings()
    if isinstance(head, tg.Fp32Linear):
        head.__class__ = torch.nn.Linear


if __name__ == "__main__":
    main()
