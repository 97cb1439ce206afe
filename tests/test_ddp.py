"""DDP for real: 2 gloo processes on CPU, ranks fed different prompts (steps 1, 7, 11, 12). The torchrun CLI
on 2 processes is test_two_nodes' one-node run."""
import json

import torch

from helpers import dist_suite, sample_batch, tg, tiny


def two_ranks(tag):
    """The trainer's run on 2 ranks (FAST, 3 steps): each rank's final weights, prompts and coefficient."""
    out = dist_suite()
    return [torch.load(out / f"{tag}_{r}.pt", weights_only=True) for r in (0, 1)]


def identical(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_ranks_end_bitwise_identical_with_one_entropy_coefficient():
    # --use_adaptive_entropy 1 --entropy_target 5 --entropy_coef_delta 0.001: the target is above any entropy,
    # so the bonus is on, and the entropy graph path runs under DDP too
    r0, r1 = two_ranks("train")
    assert identical(r0["params"], r1["params"])
    assert len(r0["prompts"]) == 3 and all(not set(p0) & set(p1) for p0, p1 in zip(r0["prompts"], r1["prompts"]))
    assert r0["entropy_coef"] == r1["entropy_coef"] == 0.003
    start = tiny()[0].state_dict()
    assert not identical(start, r0["params"])  # it trained
    # rank 0's log: the coefficient follows the rule from the world entropy, step after step
    rows = [json.loads(l) for l in open(dist_suite() / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]                               # rank 0 alone logs
    c = 0.0
    for r in rows:
        c = min(c + 0.001, 0.005) if r["entropy"] < 5.0 else max(c - 0.001, 0.0)
        assert r["entropy_coef"] == c


def test_an_moe_run_whose_micro_batches_split_groups_ends_bitwise_identical_on_both_ranks():
    # --share_prompt 1 (the default): each prompt forwarded once per micro-batch of 6 rows (groups of 4 split),
    # through the bare decoder, then its rows through the DDP wrapper.
    r0, r1 = two_ranks("moe_train")
    assert identical(r0["params"], r1["params"])
    assert all(not set(p0) & set(p1) for p0, p1 in zip(r0["prompts"], r1["prompts"]))
    assert not identical(tiny(use_moe=1)[0].state_dict(), r0["params"])   # it trained


def test_forward_through_model_module_makes_ranks_drift():
    # the same run with the famous bug: the test above would catch it
    r0, r1 = two_ranks("bypass")
    assert not identical(r0["params"], r1["params"])


def test_the_ddp_wrapper_is_freed_before_the_process_group_at_an_end_and_an_error():
    # Freed after destroy_process_group, the DDP wrapper would destroy the gloo group holding the GIL, which can hang.
    # An error whose context chain loops must end too: a walk along the chain that never stops hangs both ranks.
    # A reward's error is Python's own: it leaves cli (a traceback, exit status 1) with a note naming the function
    # and the samples of this rank's step (FAST: 4 prompts x 4 completions).
    note = ["in reward function boom, called by train_grpo.py on 16 samples"]
    for case, status, raised in (("cycle", 0, None), ("error", "raised", ["ValueError", "no", note]),
                                 ("context_cycle", "raised", ["ValueError", "a", note])):
        for r in (0, 1):
            teardown = torch.load(dist_suite() / f"{case}_{r}.pt", weights_only=True)
            assert teardown == {"status": status, "raised": raised, "ddp_alive_at_destroy": [False]}, case


def test_moe_step_with_an_expert_that_gets_no_tokens():
    out = dist_suite()
    r0, r1 = [torch.load(out / f"moe_{r}.pt", weights_only=True) for r in (0, 1)]
    for r in (r0, r1):
        assert len(r["used"]) < 4, "some expert must receive no tokens"
        assert r["router_grad"] > 0
    assert identical(r0["params"], r1["params"])


def test_moe_aux_loss_reaches_the_objective_and_the_router():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    model, tok = tiny(use_moe=1)
    input_ids, attn, comp, mask = sample_batch(model, tok)
    logps, _, aux = tg.completion_logps(model, input_ids, attn, comp.shape[1])
    # independent: router logits from a plain forward, through transformers' own load-balancing function
    out = model(input_ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                output_router_logits=True)
    want = load_balancing_loss_func(out.router_logits, model.config.num_experts, model.config.num_experts_per_tok, attn)
    torch.testing.assert_close(aux, want)
    gate = model.model.layers[0].mlp.gate.weight
    (g,) = torch.autograd.grad(model.config.router_aux_loss_coef * aux, gate)
    assert g.abs().sum() > 0
