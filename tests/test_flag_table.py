"""Every flag is wired: one row per field of Args (a new field without a row fails the first test).

A row says how the flag's effect is seen:
  step(value, check)      one grpo_step of the built-in tiny model with the flag set, against the same step at
                          the defaults; check(default_run, flagged_run) must hold (a metric, the sampled tokens,
                          the update, the coefficient, a chunk's size...)
  error(value, words)     the flag's bad value is refused before any work, naming the flag
  elsewhere("file::test") a short step cannot show it; the named test does (it must exist)
Flags that select (choices) have a row per choice where choices change the step.
"""
import ast
import dataclasses
import json
import math
import os
import re

import pytest
import torch

from helpers import ROOT, make_run, tg, tiny


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
    train_rows, _, reward_fns, weights, _ = tg.load_task(args, tok, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ref = tg.frozen_copy(model, getattr(torch, args.dtype)) if args.beta > 0 else None
    optimizer, scheduler = tg.build_optimizer(model, args)
    applied = []                              # the norm of the gradient each optimizer step receives
    optimizer.register_step_pre_hook(lambda *_: applied.append(
        torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm().item()))
    state = tg.TrainState(c=args.entropy_coef, alpha=args.entropy_coef)
    calls = {"rollout": [], "lm_logits": [], "generate": []}
    real_rollout, real_head = tg.rollout, tg.lm_logits
    real_generate = model.generate

    def rollout(*a, **k):
        out = real_rollout(*a, **k)
        calls["rollout"].append(out[0])
        return out

    def generate(**k):
        calls["generate"].append(k)
        return real_generate(**k)
    tg.rollout = rollout
    tg.lm_logits = lambda m, h: calls["lm_logits"].append(h.shape[0]) or real_head(m, h)
    model.generate = generate
    torch.manual_seed(1)
    try:
        run = make_run(model, tok, optimizer, reward_fns=reward_fns, weights=weights, scheduler=scheduler)
        run.ref_model, run.scaler = ref, tg.loss_scaler(args.dtype, "cpu")  # the trainer's own rule
        record = tg.grpo_step(args, run, train_rows[:args.batch_size], state)
    finally:
        tg.rollout, tg.lm_logits = real_rollout, real_head
    record["lr_next"] = scheduler.get_last_lr()[0]             # the step moved the schedule
    delta = {k: (v - before[k]) for k, v in model.state_dict().items()}
    return Run(record=record, delta=delta, tokens=calls["rollout"][0], state=state, calls=calls, args=args,
               applied_grad_norm=applied[-1], checkpointing=model.is_activation_checkpointing)


_default = {}


def default_run():
    if not _default:
        _default["run"] = one_step()
    return _default["run"]


def differs(key):
    """check: the logged metric `key` is not the default run's."""
    return lambda d, f: f.record[key] != d.record[key]


def update_differs(d, f):
    return any(not torch.equal(d.delta[k], f.delta[k]) for k in d.delta)


def tokens_differ(d, f):
    return d.tokens.shape != f.tokens.shape or not torch.equal(d.tokens, f.tokens)


def step(value, check, **extra):
    return ("step", value, check, extra)


def error(value, words):
    return ("error", value, words, {})


def elsewhere(where):
    return ("elsewhere", where, None, {})


def config(f):
    """The generation config the rollout handed to generate."""
    return f.calls["generate"][0]["generation_config"]


def sampler(f):
    """The logits processor that applies the sampling distribution inside generate."""
    return f.calls["generate"][0]["logits_processor"][0]


def tokens_shape(f):
    return f.tokens.shape[1]


FLAGS = {
    # what to train
    "loss_type": [step(choice, differs("loss")) for choice in ("bnpo", "dr_grpo", "dapo", "cispo")],
    "use_moe": [step(1, lambda d, f: "aux_loss" in f.record and "aux_loss" not in d.record)],  # an MoE model
    "model_name_or_path": [elsewhere("test_real_path.py::test_two_rank_run_on_saved_model_and_gsm8k_file"),
                           elsewhere("test_smollm2.py::test_gguf_run_saves_plain_folders_learns_a_step_and_resumes_bitwise")],
    "dataset": [elsewhere("test_real_path.py::test_two_rank_run_on_saved_model_and_gsm8k_file"),
                elsewhere("test_smollm2.py::test_compare_numbers_has_its_own_defaults_and_a_given_flag_wins")],
    "question_field": [elsewhere("test_real_path.py::test_parquet_with_other_field_names")],
    "answer_field": [elsewhere("test_user_paths.py::test_rows_reach_rewards_as_the_dataset_has_them_and_your_rewards_weigh_one_each")],
    "reward_funcs": [elsewhere("test_custom.py::test_reward_file_and_prompt_dataset_with_extra_columns")],
    "reward_weights": [step("3", lambda d, f: f.record["reward"] == pytest.approx(3 * d.record["reward"]))],
    "trust_remote_code": [elsewhere("test_flag_table.py::test_trust_remote_code_reaches_from_pretrained")],
    # rollout
    "num_generations": [step(2, lambda d, f: f.tokens.shape[0] == 2 * 2 and d.tokens.shape[0] == 2 * 4)],
    "batch_size": [step(1, lambda d, f: f.tokens.shape[0] == 1 * 4)],
    "micro_batch_size": [step(4, lambda d, f: len(f.calls["lm_logits"]) == 2 * len(d.calls["lm_logits"]),
                              skip_zero_advantage_rows=0)],  # every row trained: 2 micro-steps, not 1
    "micro_batch_tokens": [elsewhere("test_user_paths.py::test_auto_micro_batch_is_one_decision_for_all_ranks")],
    "max_prompt_len": [step(3, lambda d, f: f.record["truncated_prompts"] == 2 and d.record["truncated_prompts"] == 0)],
    "max_gen_len": [step(3, lambda d, f: tokens_shape(f) == 3 and tokens_shape(d) == 6)],
    "temperature": [step(0.5, lambda d, f: f.record["entropy"] < d.record["entropy"])],
    # the rollout's processor applies top-p/top-k; generate's own stay off (its default top_k is 50)
    "top_p": [step(0.5, lambda d, f: sampler(f).top_p == 0.5 and sampler(d).top_p == 1 and tokens_differ(d, f)
                   and config(f).top_p == 1.0)],
    "top_k": [step(1, lambda d, f: sampler(f).top_k == 1 and sampler(d).top_k == 0 and tokens_differ(d, f)
                   and config(f).top_k == config(d).top_k == 0)],
    "mask_truncated_completions": [step(1, lambda d, f: d.record["truncated_frac"] > 0
                                        and f.record["loss"] != d.record["loss"])],
    # objective
    "beta": [elsewhere("test_loop.py::test_kl_is_zero_at_step_1_then_positive_against_a_frozen_reference")],
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
    "use_adaptive_entropy": [step(1, lambda d, f: f.state.c != d.state.c,
                                  entropy_target=9.0)],
    "entropy_target": [step(9.0, lambda d, f: f.state.c > 0.002 > d.state.c,
                            use_adaptive_entropy=1, entropy_coef=0.002)],  # H ~2.4: below 9, above 0.2
    "entropy_coef_delta": [step(1e-3, lambda d, f: f.state.c == pytest.approx(1e-3),
                                use_adaptive_entropy=1, entropy_target=9.0)],
    "entropy_coef_min": [step(0.001, lambda d, f: f.state.c == pytest.approx(0.001),
                              use_adaptive_entropy=1, entropy_target=0.0)],
    "entropy_coef_max": [step(5e-5, lambda d, f: f.state.c == pytest.approx(5e-5),
                              use_adaptive_entropy=1, entropy_target=9.0)],
    # optimization
    "max_steps": [step(4, lambda d, f: f.record["lr_next"] != d.record["lr_next"], lr_scheduler="cosine")],
    "learning_rate": [step(1e-3, lambda d, f: f.record["lr"] == 1e-3 and update_differs(d, f))],
    "weight_decay": [step(0.5, update_differs)],
    "lr_scheduler": [step("cosine", lambda d, f: f.record["lr_next"] < d.record["lr_next"], max_steps=2)],
    "warmup_steps": [step(3, lambda d, f: f.record["lr"] == pytest.approx(BASE["learning_rate"] / 4)
                          and update_differs(d, f))],
    # every reward 0: every group ties; on (the default) no row is trained, off all 8 are
    "skip_zero_advantage_rows": [step(0, lambda d, f: d.record["rows_trained"] == 0 == len(d.calls["lm_logits"])
                                      and f.record["rows_trained"] == 8 and len(f.calls["lm_logits"]) > 0,
                                      reward_weights="0")],
    "grad_clip": [step(1e-3, lambda d, f: f.applied_grad_norm == pytest.approx(1e-3, rel=1e-4)
                       and d.applied_grad_norm > 1e-2)],
    "gradient_checkpointing": [step(1, lambda d, f: f.checkpointing and not d.checkpointing)],
    "sft_warmup_steps": [elsewhere("test_flag_table.py::test_sft_warmup_flags_change_the_warm_start")],
    "sft_learning_rate": [elsewhere("test_flag_table.py::test_sft_warmup_flags_change_the_warm_start")],
    # bookkeeping
    "seed": [elsewhere("test_flag_table.py::test_seed_decides_the_run")],
    "save_dir": [elsewhere("test_cli.py::test_short_run_writes_finite_metrics_and_a_loadable_model")],
    "save_interval": [elsewhere("test_real_path.py::test_non_finite_steps_are_skipped_then_stop_with_last_checkpoint_intact")],
    "resume": [elsewhere("test_real_path.py::test_resume_continues_exactly")],
    "eval_interval": [elsewhere("test_custom.py::test_summary_line_and_eval_size_caps_a_test_split")],
    "eval_size": [elsewhere("test_custom.py::test_summary_line_and_eval_size_caps_a_test_split")],
    "dtype": [step("bfloat16", update_differs),
              step("float16", lambda d, f: update_differs(d, f) and f.record["loss_scale"] == 2.0 ** 16
                   and "loss_scale" not in d.record)],
    # the bench's sizes: the fp32 head lowers the bf16 gap between the sampler and the trainer
    "cast_lm_head_to_fp32": [step(1, lambda d, f: f.record["sampler_logp_diff_max"]
                                  < 0.5 * d.record["sampler_logp_diff_max"], dtype="bfloat16",
                                  batch_size=4, num_generations=8, max_gen_len=16)],
    "fsdp": [elsewhere("test_fsdp.py::test_fsdp_shards_and_the_loss_forward_goes_through_the_sharded_module")],
    "rollout_cache": [step("static", lambda d, f: config(f).cache_implementation == "static"
                           and config(d).cache_implementation is None)],
    "device": [error("cuda", "--device cuda") if not torch.cuda.is_available() else
               elsewhere("test_precision.py::test_static_cache_rollout_sees_the_weights_of_the_current_step")],
    "stop_after": [elsewhere("test_real_path.py::test_resume_continues_exactly")],
    "report_to": [elsewhere("test_custom.py::test_tensorboard_events_hold_the_logged_rewards"),
                  elsewhere("test_custom.py::test_wandb_offline_run_holds_the_logged_rewards")],
    "run_name": [elsewhere("test_custom.py::test_tensorboard_events_hold_the_logged_rewards")],
}
ROWS = [(name, i) for name, rows in FLAGS.items() for i in range(len(rows))]


def test_every_args_field_has_a_row():
    fields = [f.name for f in dataclasses.fields(tg.Args)]
    assert sorted(FLAGS) == sorted(fields), (set(fields) ^ set(FLAGS))


@pytest.mark.parametrize("name, i", ROWS)
def test_flag(name, i, tmp_path):
    kind, value, check, extra = FLAGS[name][i]
    if kind == "elsewhere":
        file, test = value.split("::")
        tree = ast.parse(open(os.path.join(ROOT, "tests", file)).read())
        assert test in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, value
        return
    if kind == "error":
        from test_cli import one_line_error
        from helpers import run_cli
        line = one_line_error(run_cli(f"--{name}", value, "--save_dir", tmp_path / "run"))
        assert check in line and not (tmp_path / "run").exists()
        return
    default = one_step(**extra) if extra else default_run()
    flagged = one_step(**{**extra, name: value})
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
        args = tg.Args(batch_size=4, max_prompt_len=64, **kw)
        model, tok = tiny()
        train_rows, _ = tg.make_reverse_task(16)
        tg.sft_warmup(model, tok, train_rows, args, "cpu", 0, 1)
        return model.state_dict()
    start = tiny()[0].state_dict()
    none, two, two_fast = warm(sft_warmup_steps=0), warm(sft_warmup_steps=2), warm(sft_warmup_steps=2,
                                                                                 sft_learning_rate=1e-2)
    assert all(torch.equal(none[k], start[k]) for k in start)
    assert any(not torch.equal(two[k], start[k]) for k in start)
    assert any(not torch.equal(two[k], two_fast[k]) for k in start)


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
    tg.evaluate(model, tok, rows, lambda t, r, ids: texts.extend(t) or [0.0] * len(t), tg.Args(max_gen_len=4), 0, 1, "cpu")
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


def test_progress_bar_shows_reward_eval_generate_share_memory_and_the_ratio(tmp_path, capsys):
    tg.main(["--batch_size", "2", "--num_generations", "4", "--max_gen_len", "4", "--sft_warmup_steps", "0",
             "--eval_interval", "1", "--eval_size", "4", "--max_steps", "1", "--save_dir", str(tmp_path)])
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()
    last = [line for line in bar if line.startswith("grpo:") and "1/1" in line][-1]
    row = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")][-1]
    shown_eval = float(re.search(r"eval=([0-9.]+)", last).group(1))  # tqdm writes a float with 3 digits
    assert f"reward={row['reward']:.3f}" in last and shown_eval == pytest.approx(row["eval_accuracy"], abs=5e-3)
    assert f"gen={row['generate_share']:.0%}" in last and f"mem={row['peak_mem_gib']:.1f}G" in last
    assert f"is_max={row['is_ratio_max']:.3f}" in last                     # the sampler/trainer ratio
    assert f"rows={row['rows_trained']}/8" in last                         # rows trained of the step's
    for metric in ("sampler_logp_diff_mean", "sampler_logp_diff_max", "is_ratio_min", "is_ratio_mean",
                   "is_ratio_max"):                                       # in every step's record
        assert math.isfinite(row[metric]), metric
