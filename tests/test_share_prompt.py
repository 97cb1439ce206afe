"""--share_prompt: a group's prompt goes through the model once and its G rows read its KV cache. Every number is
checked against the plain path (--share_prompt 0), where each row forwards its whole prompt; the plain path itself is
checked against naive references in the other files."""
import copy
import json

import pytest
import torch

from helpers import make_run, step_on_batch, tg, tiny

B, G = 4, 4


def batch_of(model, tok, seed=0):
    """A sampled batch of 4 prompts of different lengths (left padding), one cut by --max_prompt_len 6, and
    completions of up to 5 tokens, some without EOS: input_ids, attention_mask, completion mask, advantages."""
    prompts = [p for p in ("abcdefgh=", "ab=", "abcd=", "cab=") for _ in range(G)]
    ids, am, cut = tg.tokenize_prompts(tok, prompts, 6, "cpu")
    assert cut == G and am[:, 0].sum() == G                    # one prompt cut; the others left-padded
    torch.manual_seed(seed)
    comp, mask, truncated = tg.rollout(model, ids, am, tok, max_gen_len=5)
    assert 0 < truncated.sum() < B * G                          # some completions never ended
    advantages = torch.randn(B * G, generator=torch.Generator().manual_seed(seed))
    return dict(input_ids=torch.cat([ids, comp], 1), attention_mask=torch.cat([am, mask], 1), mask=mask,
                advantages=advantages)


def assert_grads_close(got, want):
    """Each parameter's gradient within 1e-4 of the plain path's, relative to its norm."""
    for g, w in zip(got, want):
        assert (g - w).norm() <= 1e-4 * w.norm() + 1e-9, ((g - w).norm(), w.norm())


def decoder_calls(*models):
    """The (rows, tokens) of every call of the models' decoders in order, from forward pre-hooks."""
    calls = []
    hooks = [model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
        for model in models]
    return calls, hooks


def step(flags, share, model, tok, batch):
    """One step on `batch` with a copy of `model`: the record and the gradients each update received."""
    model = copy.deepcopy(model)
    args = tg.parse_args(["--batch_size", str(B), "--num_generations", str(G), "--max_gen_len", "5", "--grad_clip",
                          "0", "--share_prompt", str(share), *flags])
    run = make_run(model, tok, torch.optim.SGD(model.parameters(), lr=0.5))
    if args.beta > 0:
        run.ref_model = tg.frozen_copy(model, torch.float32)
    state = tg.TrainState(entropy_coef_applied=args.entropy_coef)
    calls, hooks = decoder_calls(model, *[run.ref_model] * (args.beta > 0))
    try:
        record, received = step_on_batch(args, run, batch, state)
    finally:
        for hook in hooks:
            hook.remove()
    return record, received, calls


CASES = {"grpo": [], "bnpo": ["--loss_type", "bnpo"], "dr_grpo": ["--loss_type", "dr_grpo"],
         "dapo": ["--loss_type", "dapo"], "cispo": ["--loss_type", "cispo"],
         "beta and mu": ["--beta", "0.1", "--num_iterations", "2"], "gspo": ["--importance_sampling_level", "sequence"],
         "entropy bonus": ["--entropy_coef", "0.05"], "micro-batches split groups": ["--micro_batch_size", "6"]}


@pytest.mark.parametrize("case", CASES)
def test_a_shared_prompt_gives_the_plain_paths_loss_and_gradients(case):
    model, tok = tiny()
    batch = batch_of(model, tok)
    plain, plain_grads, _ = step(CASES[case], 0, model, tok, batch)
    shared, shared_grads, calls = step(CASES[case], 1, model, tok, batch)
    assert len(shared_grads) == len(plain_grads) == (2 if "--num_iterations" in CASES[case] else 1)
    for key in ("loss", "policy_loss", "kl", "clip_ratio", "entropy"):
        assert shared[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-6), key
    for update_plain, update_shared in zip(plain_grads, shared_grads):
        assert_grads_close(update_shared, update_plain)
    # The shared path ran: no forward of the step held a prompt per row.
    P = batch["input_ids"].shape[1] - batch["mask"].shape[1]
    assert all(tokens in (P - 1, batch["mask"].shape[1]) for _, tokens in calls)


def test_each_pass_forwards_a_prompt_once_per_micro_batch_that_holds_its_rows():
    # beta > 0 and mu = 2: the reference, the old log-probs and two updates, each over micro-batches of 6, 6 and 4
    # rows. Rows 0-5 hold prompts 0 and 1, rows 6-11 prompts 1 and 2, rows 12-15 prompt 3: 5 prompt forwards a pass.
    model, tok = tiny()
    batch = batch_of(model, tok)
    P = batch["input_ids"].shape[1] - batch["mask"].shape[1]
    T = batch["mask"].shape[1]
    flags = ["--beta", "0.1", "--num_iterations", "2", "--micro_batch_size", "6"]
    _, _, calls = step(flags, 1, model, tok, batch)
    one_pass = [(2, P - 1), (6, T), (2, P - 1), (6, T), (1, P - 1), (4, T)]
    assert calls == one_pass * 4
    _, _, calls = step(flags, 0, model, tok, batch)
    assert calls == [(6, P + T), (6, P + T), (4, P + T)] * 4
    tokens = sum(rows * width for rows, width in one_pass)
    assert tokens == 5 * (P - 1) + B * G * T < B * G * (P + T)


@pytest.mark.parametrize("use_moe", [0, 1])
@pytest.mark.parametrize("do_sample", [False, True])
def test_the_rollout_prefills_each_prompt_once_and_samples_what_the_plain_rollout_samples(use_moe, do_sample):
    model, tok = tiny(use_moe)
    prompts = [p for p in ("abcdefgh=", "ab=", "abcd=", "cab=") for _ in range(G)]
    ids, am, _ = tg.tokenize_prompts(tok, prompts, 64, "cpu")
    out = {}
    for group_size in (1, G):
        calls, hooks = decoder_calls(model)
        torch.manual_seed(0)
        try:
            out[group_size] = tg.rollout(model, ids, am, tok, max_gen_len=6, do_sample=do_sample,
                                         group_size=group_size)
        finally:
            hooks[0].remove()
        out[group_size, "prefill"] = calls[:2]
    for plain, shared in zip(out[1], out[G]):
        assert torch.equal(plain, shared)
    P = ids.shape[1]
    assert out[1, "prefill"] == [(B * G, P), (B * G, 1)]
    assert out[G, "prefill"] == [(B, P - 1), (B * G, 1)]         # each prompt once, then each row's last token


def moe_forward(model, batch, share):
    """The MoE's log-probs, its router loss and the gradient of sum(logp) alone."""
    model.zero_grad(set_to_none=True)
    T = batch["mask"].shape[1]
    logps, _, aux = tg.completion_logps(model, batch["input_ids"], batch["attention_mask"], T, share_prompt=share)
    (logps * batch["mask"]).sum().backward(retain_graph=True)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return logps.detach(), aux, grads


def test_an_moe_shares_the_prompt_and_its_router_loss_counts_each_prompt_token_once():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    model, tok = tiny(use_moe=1)
    batch = batch_of(model, tok)
    plain_logps, plain_aux, plain_grads = moe_forward(model, batch, False)
    shared_logps, shared_aux, shared_grads = moe_forward(model, batch, True)
    m = batch["mask"].bool()
    torch.testing.assert_close(shared_logps[m], plain_logps[m], rtol=0, atol=1e-5)
    assert_grads_close(shared_grads, plain_grads)
    # transformers' own loss over the plain forward's routers, weighing the tokens the shared path routes: each
    # prompt's first P - 1 tokens in its first row only, and every row's T tokens that predict one.
    ids, am = batch["input_ids"], batch["attention_mask"]
    T = m.shape[1]
    P = ids.shape[1] - T
    out = model(ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0), output_router_logits=True)
    torch.testing.assert_close(plain_aux, out.aux_loss)
    counted = torch.zeros_like(am)
    counted[::G, :P - 1] = am[::G, :P - 1]
    counted[:, P - 1:-1] = am[:, P - 1:-1]
    want = load_balancing_loss_func(out.router_logits, model.num_experts, model.num_experts_per_tok, counted)
    torch.testing.assert_close(shared_aux, want, rtol=1e-5, atol=1e-6)
    assert abs(shared_aux.item() - plain_aux.item()) > 1e-4           # the rule differs from the plain path's


def test_with_gradient_checkpointing_the_trained_forward_runs_plain_and_a_dropped_cache_stops(monkeypatch):
    # A checkpointed layer drops the cache when it runs with grad, so the training forward takes whole rows.
    model, tok = tiny()
    batch = batch_of(model, tok)
    _, plain_grads, _ = step([], 0, model, tok, batch)
    model.activation_checkpointing_enable({"use_reentrant": False})
    _, grads, calls = step([], 1, model, tok, batch)
    P, T = batch["input_ids"].shape[1] - batch["mask"].shape[1], batch["mask"].shape[1]
    assert calls == [(B * G, P + T)]
    assert_grads_close(grads[0], plain_grads[0])
    # Were it shared anyway, the forward on the cache would see no prompt: that stops instead of training on it.
    monkeypatch.setattr(type(model), "is_activation_checkpointing", property(lambda self: False))
    with pytest.raises(tg.TrainerError, match="did not read its prompt's KV cache"):
        step([], 1, model, tok, batch)


def test_under_bfloat16_a_shared_prompt_stays_within_bfloat16_rounding():
    # Under autocast the two paths sum in another order in bfloat16 (8 bits of mantissa): within 0.05 nats.
    model, tok = tiny()
    batch = batch_of(model, tok)
    T = batch["mask"].shape[1]
    logps = {}
    calls, hooks = decoder_calls(model)
    for share in (False, True):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logps[share] = tg.completion_logps(model, batch["input_ids"], batch["attention_mask"], T,
                                               share_prompt=share)[0]
    hooks[0].remove()
    P = batch["input_ids"].shape[1] - T
    assert calls == [(B * G, P + T), (B, P - 1), (B * G, T)]
    m = batch["mask"].bool()
    torch.testing.assert_close(logps[True][m], logps[False][m], rtol=0, atol=0.05)


@pytest.mark.parametrize("share", [0, 1])
def test_a_step_samples_its_groups_on_one_prefill_per_prompt(share):
    model, tok = tiny()
    rows = tg.make_reverse_task(16)[0][:B]
    args = tg.parse_args(["--batch_size", str(B), "--num_generations", str(G), "--max_gen_len", "5",
                          "--share_prompt", str(share)])
    run = make_run(model, tok, torch.optim.SGD(model.parameters(), lr=0.1), reward_fns=[tg.reverse_reward],
                   weights=[1.0])
    calls, hooks = decoder_calls(model)
    try:
        tg.grpo_step(args, run, rows, tg.TrainState())
    finally:
        hooks[0].remove()
    P = len(rows[0]["prompt"])                                   # one token a character, no BOS
    assert calls[:2] == ([(B, P - 1), (B * G, 1)] if share else [(B * G, P), (B * G, 1)])


def test_a_resume_keeps_its_runs_prompt_rule(tmp_path, capsys):
    # A run from before --share_prompt (its args.json lacks the flag) goes on with whole rows. Under a shared
    # prompt, checkpointing changes the sums' order (a note) and, for an MoE, what the router loss counts (refused).
    from helpers import FAST
    from test_cli import in_process, one_line_error
    common = [*FAST, "--max_steps", "3", "--stop_after", "1", "--save_interval", "1"]
    for moe in ("0", "1"):
        tg.main([*common, "--use_moe", moe, "--save_dir", str(tmp_path / moe)])
    for path in (tmp_path / "0" / "args.json", tmp_path / "0" / "checkpoint-1" / "args.json"):
        saved = json.loads(path.read_text())
        saved.pop("share_prompt")
        path.write_text(json.dumps(saved))
    assert tg.parse_args(["--resume", "auto", "--save_dir", str(tmp_path / "0")]).share_prompt == 0
    line = one_line_error(in_process(capsys, "--gradient_checkpointing", "1", "--resume", "auto", "--save_dir",
                                     tmp_path / "1"))
    assert "--gradient_checkpointing 1 differs from 0" in line
    (tmp_path / "0" / "args.json").write_text(json.dumps({**saved, "share_prompt": 1}))
    (tmp_path / "0" / "checkpoint-1" / "args.json").write_text(json.dumps({**saved, "share_prompt": 1}))
    capsys.readouterr()
    tg.parse_args(["--gradient_checkpointing", "1", "--resume", "auto", "--save_dir", str(tmp_path / "0")])
    assert "--gradient_checkpointing changed at this resume" in capsys.readouterr().out


def test_rows_of_one_prompt_share_it_wherever_they_sit():
    # A fork may interleave its groups (row i holds prompt i % B): each distinct prompt is still forwarded once.
    model, tok = tiny()
    batch = batch_of(model, tok)
    order = torch.arange(B * G).view(B, G).t().reshape(-1)     # rows 0, 4, 8, 12, 1, 5, ...
    ids, am, mask = batch["input_ids"][order], batch["attention_mask"][order], batch["mask"][order]
    T = mask.shape[1]
    calls, hooks = decoder_calls(model)
    with torch.no_grad():
        plain = tg.completion_logps(model, ids, am, T)[0]
        shared = tg.completion_logps(model, ids, am, T, share_prompt=True)[0]
    hooks[0].remove()
    P = ids.shape[1] - T
    assert calls == [(B * G, P + T), (B, P - 1), (B * G, T)]
    torch.testing.assert_close(shared[mask.bool()], plain[mask.bool()], rtol=0, atol=1e-5)


def test_a_model_that_caches_recurrent_states_is_refused_before_any_work(tmp_path):
    # A linear-attention layer keeps one state of the whole prompt, which rows cannot select or extend.
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    _, tok = tiny()
    config = Qwen3NextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
                             linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=0,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    Qwen3NextForCausalLM(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    args = tg.parse_args(["--model_name_or_path", str(tmp_path), "--dataset", "compare_numbers", "--save_dir",
                          str(tmp_path / "run")])
    with pytest.raises(tg.TrainerError, match="caches recurrent states, not keys and values; run with --share_pro"):
        tg.load_model_and_tokenizer(args, torch.device("cpu"))
    args = tg.parse_args(["--model_name_or_path", str(tmp_path), "--dataset", "compare_numbers", "--share_prompt", "0",
                          "--save_dir", str(tmp_path / "run")])
    tg.load_model_and_tokenizer(args, torch.device("cpu"))
