"""Every flag changes what it should: one or more rows per flag, each one GRPO step with the flag set against
the same step at the defaults.

A row says how the flag's effect is seen:
  step(value, check)      one grpo_step of the built-in tiny model with the flag set, against the same step at
                          the defaults; check(default_run, flagged_run) must hold (a metric, the sampled tokens,
                          the update, the coefficient, a chunk's size...)
  error(value, words)     the flag's bad value is refused before any work, naming the flag
Flags that select (choices) have a row per choice where choices change the step. The flags a single step cannot
show are tested where they act:
  model_name_or_path, dataset        test_real_path::test_two_rank_run_on_saved_model_and_gsm8k_file
  reward_funcs                       test_custom::test_reward_file_and_prompt_dataset_with_extra_columns
  trust_remote_code, sft_warmup_steps, sft_learning_rate, sft_batch_size, seed       below
  save_dir, save_interval, resume, stop_after                       test_user_paths::test_tensorboard_after_a_resume..
                                     and test_real_path::test_resume_continues_exactly
  eval_interval, eval_size           test_custom::test_summary_line_and_eval_size_caps_a_test_split
  report_to, run_name                test_custom::test_tensorboard_events_hold_the_logged_rewards, ..wandb..
"""
import json
import re

import pytest
import torch

from helpers import evaluate_with, make_run, tg, tiny
from test_real_path import one_thread  # noqa: F401  (an autouse fixture)


# ---- one step, at the defaults or with flags set ----
BASE = {"batch_size": 2, "num_generations": 4, "max_gen_len": 6, "sft_warmup_steps": 0, "eval_interval": 0,
        "learning_rate": 1e-2}


class Run:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def one_step(**flags):
    """grpo_step of the trainer's own built-in model and task (load_model_and_tokenizer, load_task,
    build_optimizer) on 2 fixed prompts; returns what it logged, the weight update, the sampled tokens, the
    loop state, the norm of the gradient the optimizer applied, and what a few inner functions were given."""
    settings = {**BASE, **flags}
    args = tg.parse_args([a for k, v in settings.items() for a in (f"--{k}", str(v))])
    torch.manual_seed(0)                      # fixed: --seed acts in train(), tested through main below
    model, tok = tg.load_model_and_tokenizer(args, torch.device("cpu"))
    train_rows, _, reward_fns, weights, _ = tg.load_task(args, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ref = tg.frozen_copy(model, getattr(torch, args.dtype)) if args.beta > 0 else None
    optimizer, scheduler = tg.build_optimizer(model, args)
    applied = []                              # the norm of the gradient each optimizer step receives
    optimizer.register_step_pre_hook(lambda *_: applied.append(
        torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm().item()))
    state = tg.TrainState(entropy_coef=args.entropy_coef, entropy_coef_applied=args.entropy_coef)
    calls = {"rollout": [], "lm_logits": [], "logp_rows": [], "prompt_width": [], "decoder_tokens": []}
    hook = model.get_decoder().register_forward_pre_hook(   # every token through the model, rollout included
        lambda module, a, kw: calls["decoder_tokens"].append(kw["input_ids"].numel()), with_kwargs=True)
    real_rollout, real_head, real_logps = tg.rollout, tg.lm_logits, tg.completion_logps

    def rollout(*a, **k):
        calls["prompt_width"].append(a[1].shape[1])
        out = real_rollout(*a, **k)
        calls["rollout"].append(out[0])
        return out

    def completion_logps(m, input_ids, *a, **k):
        if torch.is_grad_enabled():        # the rows of each forward that trains
            calls["logp_rows"].append(input_ids.shape[0])
        return real_logps(m, input_ids, *a, **k)
    tg.rollout, tg.completion_logps = rollout, completion_logps
    tg.lm_logits = lambda m, h: calls["lm_logits"].append(h.shape[0]) or real_head(m, h)
    torch.manual_seed(1)
    try:
        run = make_run(model, tok, optimizer, reward_fns=reward_fns, weights=weights, scheduler=scheduler)
        run.ref_model, run.scaler = ref, tg.loss_scaler(args.dtype, "cpu")  # the trainer's own rule
        record, _ = tg.grpo_step(args, run, train_rows[:args.batch_size], state)
    finally:
        tg.rollout, tg.lm_logits, tg.completion_logps = real_rollout, real_head, real_logps
        hook.remove()
    record["lr_next"] = scheduler.get_last_lr()[0]             # the step moved the schedule
    delta = {k: (v - before[k]) for k, v in model.state_dict().items()}
    return Run(record=record, delta=delta, tokens=calls["rollout"][0], state=state, calls=calls, args=args,
               applied_grad_norm=applied[-1], checkpointing=model.is_activation_checkpointing)


_steps = {}


def cached_step(**flags):
    """one_step, run once per set of flags for the whole table: rows share their default runs (and a row's
    flagged run may be another row's default). A run is deterministic, and the checks only read it."""
    key = tuple(sorted((k, str(v)) for k, v in flags.items()))
    if key not in _steps:
        _steps[key] = one_step(**flags)
    return _steps[key]


def differs(key):
    """check: the logged metric `key` is not the default run's."""
    return lambda d, f: f.record[key] != d.record[key]


def update_differs(d, f):
    return any(not torch.equal(d.delta[k], f.delta[k]) for k in d.delta)


def step(value, check, **extra):
    return ("step", value, check, extra)


def error(value, words):
    return ("error", value, words, {})


def tokens_shape(f):
    return f.tokens.shape[1]


FLAGS = {
    # what to train
    "loss_type": [step(choice, differs("loss")) for choice in ("bnpo", "dr_grpo", "dapo", "cispo")],
    "use_moe": [step(1, lambda d, f: "aux_loss" in f.record and "aux_loss" not in d.record)],  # an MoE model
    "reward_weights": [step("3", lambda d, f: f.record["reward"] == pytest.approx(3 * d.record["reward"]))],
    # rollout
    "num_generations": [step(2, lambda d, f: f.tokens.shape[0] == 2 * 2 and d.tokens.shape[0] == 2 * 4)],
    "batch_size": [step(1, lambda d, f: f.tokens.shape[0] == 1 * 4)],
    "micro_batch_size": [step(4, lambda d, f: len(f.calls["lm_logits"]) == 2 * len(d.calls["lm_logits"])),
                         # the last micro-batch holds fewer rows: 8 rows in 3 + 3 + 2
                         step(3, lambda d, f: f.calls["logp_rows"] == [3, 3, 2] and d.calls["logp_rows"] == [8])],
    "max_prompt_len": [step(3, lambda d, f: f.record["prompts_cut"] == 2 and d.record["prompts_cut"] == 0
                            and f.calls["prompt_width"] == [3])],
    "max_gen_len": [step(3, lambda d, f: tokens_shape(f) == 3 and tokens_shape(d) == 6)],
    "temperature": [step(0.5, lambda d, f: f.record["entropy"] < d.record["entropy"])],
    # 0: each row forwards its whole prompt, in the rollout's prefill and the training forward
    "share_prompt": [step(0, lambda d, f: f.calls["decoder_tokens"][0] == 8 * f.calls["prompt_width"][0]
                          and d.calls["decoder_tokens"][0] == 2 * (d.calls["prompt_width"][0] - 1)
                          and sum(f.calls["decoder_tokens"]) > sum(d.calls["decoder_tokens"]))],
    "mask_truncated_completions": [step(1, lambda d, f: d.record["truncated_frac"] > 0
                                        and f.record["loss"] != d.record["loss"])],
    # objective: the second update (mu = 2) moved away from the frozen reference
    "beta": [step(0.04, lambda d, f: f.record["kl"] > 0 == d.record["kl"] and update_differs(d, f),
                  num_iterations=2)],
    "epsilon": [step(0.01, lambda d, f: f.record["clip_ratio"] > d.record["clip_ratio"], num_iterations=2,
                     learning_rate=1e-3)],
    "epsilon_high": [step(0.01, lambda d, f: f.record["clip_ratio"] > d.record["clip_ratio"], num_iterations=2,
                          learning_rate=1e-3)],
    "num_iterations": [step(2, update_differs)],
    "scale_rewards": [step(choice, differs("advantage_std")) for choice in ("batch", "none")],
    # GSPO: with mu = 2 the second update's ratios differ from 1; one per sequence is another update
    "importance_sampling_level": [step("sequence", lambda d, f: update_differs(d, f)
                                       and f.record["clip_ratio"] != d.record["clip_ratio"],
                                       num_iterations=2)],
    # entropy
    "logp_chunk_size": [step(7, lambda d, f: max(f.calls["lm_logits"]) == 7 and max(d.calls["lm_logits"]) > 7)],
    "entropy_coef": [step(0.5, lambda d, f: f.record["loss"] != d.record["loss"] and update_differs(d, f))],
    "use_adaptive_entropy": [step(1, lambda d, f: f.state.entropy_coef != d.state.entropy_coef,
                                  entropy_target=9.0)],
    "entropy_target": [step(9.0, lambda d, f: f.state.entropy_coef > 0.002 > d.state.entropy_coef,
                            use_adaptive_entropy=1, entropy_coef=0.002)],  # H ~2.4: below 9, above 0.2
    "entropy_coef_delta": [step(1e-3, lambda d, f: f.state.entropy_coef == pytest.approx(1e-3),
                                use_adaptive_entropy=1, entropy_target=9.0)],
    "entropy_coef_min": [step(0.001, lambda d, f: f.state.entropy_coef == pytest.approx(0.001),
                              use_adaptive_entropy=1, entropy_target=0.0)],
    "entropy_coef_max": [step(5e-5, lambda d, f: f.state.entropy_coef == pytest.approx(5e-5),
                              use_adaptive_entropy=1, entropy_target=9.0)],
    # optimization
    "max_steps": [step(4, lambda d, f: f.record["lr_next"] != d.record["lr_next"], lr_scheduler="cosine")],
    "learning_rate": [step(1e-3, lambda d, f: f.record["learning_rate"] == 1e-3 and update_differs(d, f))],
    "weight_decay": [step(0.5, update_differs)],
    "lr_scheduler": [step("cosine", lambda d, f: f.record["lr_next"] < d.record["lr_next"], max_steps=2)],
    "warmup_steps": [step(3, lambda d, f: f.record["learning_rate"] == pytest.approx(BASE["learning_rate"] / 4)
                          and update_differs(d, f))],
    "grad_clip": [step(1e-3, lambda d, f: f.applied_grad_norm == pytest.approx(1e-3, rel=1e-4)
                       and d.applied_grad_norm > 1e-2)],
    "gradient_checkpointing": [step(1, lambda d, f: f.checkpointing and not d.checkpointing)],
    # bookkeeping
    "dtype": [step("bfloat16", update_differs),
              step("float16", lambda d, f: update_differs(d, f) and f.record["loss_scale"] == 2.0 ** 16
                   and "loss_scale" not in d.record)],
    "device": [error("cuda", "--device cuda")] if not torch.cuda.is_available() else [],
}
ROWS = [(name, i) for name, rows in FLAGS.items() for i in range(len(rows))]


@pytest.mark.parametrize("name, i", ROWS)
def test_flag(name, i, tmp_path, capsys):
    kind, value, check, extra = FLAGS[name][i]
    if kind == "error":
        from test_cli import in_process, one_line_error
        line = one_line_error(in_process(capsys, f"--{name}", value, "--save_dir", tmp_path / "run"))
        assert check in line and not (tmp_path / "run").exists()
        return
    default = cached_step(**extra)
    flagged = cached_step(**{**extra, name: value})
    assert getattr(flagged.args, name) == type(getattr(default.args, name))(value)
    assert check(default, flagged), f"--{name} {value} changed nothing it should"


# ---- the rows that point here ----
def test_trust_remote_code_reaches_from_pretrained(tmp_path, monkeypatch):
    import transformers
    seen = []
    for cls in (transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", classmethod(
            lambda c, *a, **k: seen.append(k.get("trust_remote_code")) or (_ for _ in ()).throw(OSError("stop"))))
    for flag in (0, 1):
        args = tg.Args(model_name_or_path="someone/model", dataset="gsm8k", trust_remote_code=flag)
        with pytest.raises(tg.TrainerError):
            tg.load_model_and_tokenizer(args, torch.device("cpu"))
    assert seen == [False, True]


def test_sft_warmup_flags_change_the_warm_start(tmp_path):
    def warm(**kw):
        args = tg.Args(**{"sft_batch_size": 4, "max_prompt_len": 64, **kw})
        model, tok = tiny()
        train_rows, _ = tg.make_reverse_task(16)
        tg.sft_warmup(model, tok, train_rows, args, "cpu", 0, 1)
        return model.state_dict()
    start = tiny()[0].state_dict()
    none, two, two_fast = warm(sft_warmup_steps=0), warm(sft_warmup_steps=2), warm(sft_warmup_steps=2,
                                                                                 sft_learning_rate=1e-2)
    two_small = warm(sft_warmup_steps=2, sft_batch_size=2)
    assert all(torch.equal(none[k], start[k]) for k in start)
    assert any(not torch.equal(two[k], start[k]) for k in start)
    assert any(not torch.equal(two[k], two_fast[k]) for k in start)
    assert any(not torch.equal(two[k], two_small[k]) for k in start)


def test_seed_decides_the_run(tmp_path):
    def run(seed, name):
        tg.main(["--batch_size", "2", "--num_generations", "4", "--max_gen_len", "6", "--sft_warmup_steps", "2",
                 "--eval_interval", "0", "--max_steps", "1", "--seed", str(seed), "--save_dir", str(tmp_path / name)])
        return open(tmp_path / name / "metrics.jsonl").read().split('"step_time"')[0]
    assert run(0, "a") == run(0, "b") != run(5, "c")


# ---- behaviours the README promises in words ----
def test_held_out_evaluation_decodes_greedily():
    model, tok = tiny(seed=2)
    rows = [{"prompt": p, "answer": ""} for p in ("abc=", "hgfedcba=", "ba=", "cabde=")]
    texts = []
    evaluate_with(model, tok, rows, lambda completions, **k: texts.extend(completions) or [0.0] * len(completions),
                  tg.Args(max_gen_len=4))
    for row, text in zip(rows, texts):  # by hand: append the argmax token, one at a time, until EOS
        ids = tok(row["prompt"], add_special_tokens=False, return_tensors="pt").input_ids
        out = []
        with torch.no_grad():
            for _ in range(4):
                nxt = model(ids).logits[0, -1].argmax().item()
                if nxt == tok.eos_token_id:
                    break
                out.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
        assert text == tok.decode(out, skip_special_tokens=True)


def test_progress_bar_shows_the_reward_and_the_eval(tmp_path, capsys):
    tg.main(["--batch_size", "2", "--num_generations", "4", "--max_gen_len", "4", "--sft_warmup_steps", "0",
             "--eval_interval", "1", "--eval_size", "4", "--max_steps", "1", "--save_dir", str(tmp_path)])
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()
    last = [line for line in bar if line.startswith("grpo:") and "1/1" in line][-1]
    row = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")][-1]
    shown_eval = float(re.search(r"eval=([0-9.]+)", last).group(1))  # tqdm writes a float with 3 digits
    assert f"reward={row['reward']:.3f}" in last and shown_eval == pytest.approx(row["eval_accuracy"], abs=5e-3)
