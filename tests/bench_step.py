"""Benchmark one GRPO step at a real model's size: s/step, share of it in generate, peak memory.

    python tests/bench_step.py                      # Qwen2.5-0.5B shape, CPU-sized batch (or the GPU batch on CUDA)
    python tests/bench_step.py --small              # a tiny model: a dry run of the script itself
    python tests/bench_step.py -- --gradient_checkpointing 0 --micro_batch_size 0     # extra trainer flags
    python tests/bench_step.py --prompts 1 --generations 4 --new_tokens 16 -- --max_prompt_len 64 --dtype float32
                                                    # a CPU without native bf16 (there bf16 matmuls are emulated)

It builds a random-weight model with Qwen2.5-0.5B's published shape (896 hidden, 24 layers, 14 heads, 2 KV
heads, 4864 MLP, tied 151,936-token vocabulary) and a tokenizer of the same vocabulary size in-process (no
download), saves them with save_pretrained, and trains on tests/data/gsm8k_sample.jsonl through the real
path (`from_pretrained`, bf16 compute, the real-model defaults for the flags it does not set: micro-batches of
8 rows, gradient checkpointing on). When `trl` is importable it runs TRL's GRPOTrainer on the same model, data
and batch for comparison (trl is not a dependency). pytest does not collect this file.
"""
import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train_grpo as tg  # noqa: E402

DATA = os.path.join(ROOT, "tests", "data", "gsm8k_sample.jsonl")
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build(path, small, vocab_size=None):
    """A character tokenizer padded with filler tokens to the vocabulary size, and the model, saved to path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, Regex
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    vocab_size = vocab_size or (4096 if small else 151936)
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for c in "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,:;!?$%#+-*/=()'\"\n<>_":
        vocab.setdefault(c, len(vocab))
    vocab.update({f"<f{i}>": i for i in range(len(vocab), vocab_size)})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHAT
    shape = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2) if small else
             dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab_size, tie_word_embeddings=True, pad_token_id=0,
                                         eos_token_id=2, bos_token_id=None, max_position_embeddings=32768, **shape))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def ours(model_dir, save_dir, a, extra):
    flags = ["--model_name_or_path", model_dir, "--dataset", DATA, "--dtype", "bfloat16", "--batch_size", str(a.prompts),
             "--num_generations", str(a.generations), "--max_gen_len", str(a.new_tokens), "--max_prompt_len", "4096",
             "--beta", "0.04", "--learning_rate", "1e-6", "--max_steps", str(a.steps), "--eval_interval", "0",
             "--save_dir", save_dir, *extra]
    tg.main(flags)
    steps = [json.loads(l) for l in open(os.path.join(save_dir, "metrics.jsonl"))]
    later = steps[1:] or steps                                                    # the first step warms up
    mean = lambda k: sum(r[k] for r in later) / len(later)
    return {"who": "train_grpo", "s_per_step": mean("step_time"), "generate_s": mean("generate_time"),
            "generate_share": mean("generate_time") / mean("step_time"),
            "peak_mem_gib": max(r["peak_mem_gib"] for r in steps), "first_step_s": steps[0]["step_time"]}


def trl(model_dir, save_dir, a):
    """TRL's GRPOTrainer at its defaults (fp32 weights, bf16 autocast on a GPU, checkpointing on) and our batch."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer
    rows = [json.loads(l) for l in open(DATA)]
    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}]} for r in rows])
    times = []

    def reward(completions, **kw):
        return [0.0 for _ in completions]
    cfg = GRPOConfig(output_dir=save_dir, per_device_train_batch_size=a.prompts * a.generations,
                     num_generations=a.generations, max_completion_length=a.new_tokens, beta=0.04,
                     learning_rate=1e-6, max_steps=a.steps, logging_steps=1, save_strategy="no", report_to=[],
                     bf16=torch.cuda.is_available(), gradient_checkpointing=True)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=cfg, train_dataset=ds)
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def on_step_begin(self, *args, **kw):
            self.t = time.time()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()

        def on_step_end(self, *args, **kw):
            times.append((time.time() - self.t, torch.cuda.max_memory_allocated() / 2**30
                          if torch.cuda.is_available() else tg.peak_memory_gib("cpu")))
    trainer.add_callback(Timer())
    trainer.train()
    later = times[1:] or times
    return {"who": "trl GRPOTrainer (defaults, gradient checkpointing on)",
            "s_per_step": sum(t for t, _ in later) / len(later), "peak_mem_gib": max(m for _, m in times)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a tiny model instead of the Qwen2.5-0.5B shape")
    gpu = torch.cuda.is_available()
    p.add_argument("--prompts", type=int, default=8 if gpu else 2)
    p.add_argument("--generations", type=int, default=8 if gpu else 4)
    p.add_argument("--new_tokens", type=int, default=256 if gpu else 32)
    p.add_argument("--steps", type=int, default=5 if gpu else 3)
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tmp = tempfile.TemporaryDirectory()   # removed when this process ends (a run leaves GBs)
    work = tmp.name
    n = build(os.path.join(work, "model"), a.small)
    device = torch.cuda.get_device_name() if gpu else f"CPU ({os.cpu_count()} cores)"
    print(f"model: {'tiny' if a.small else 'Qwen2.5-0.5B shape'}, {n / 1e6:.0f}M parameters; {device}; "
          f"{a.prompts} prompts x {a.generations} completions, {a.new_tokens} new tokens, "
          f"{extra[extra.index('--dtype') + 1] if '--dtype' in extra else 'bfloat16'} compute, beta 0.04")
    results = [ours(os.path.join(work, "model"), os.path.join(work, "ours"), a, extra)]
    if importlib.util.find_spec("trl") is None:   # `import trl` here would hide the function trl()
        print("trl is not installed: no comparison")
    else:
        results.append(trl(os.path.join(work, "model"), os.path.join(work, "trl"), a))
    for r in results:
        print("RESULT " + json.dumps(r))


if __name__ == "__main__":
    main()
