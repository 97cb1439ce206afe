"""Functions run in 2 spawned gloo processes (they must live in an importable module)."""
import contextlib
import copy
import gc
import json
import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
import torch.distributed as dist

from helpers import evaluate_with, make_run, sample_batch, tg, tiny


def suite(rank, world, out_dir, jobs, ports):
    """Several workers one after the other in one pair of processes: a pair's start-up (torch, transformers)
    costs more than most workers. jobs: (name, args) each; every worker opens and closes its own process group,
    as the trainer's main does, each at its own port (a second tg.main at the first one's port hung here)."""
    for (name, args), port in zip(jobs, ports):
        os.environ["MASTER_PORT"] = str(port)
        getattr(sys.modules[__name__], name)(rank, world, *args)


@contextlib.contextmanager
def patched(**stand_ins):
    """tg's functions replaced by stand-ins, and put back however the block ends (later workers see tg whole)."""
    real = {k: getattr(tg, k) for k in stand_ins}
    for k, v in stand_ins.items():
        setattr(tg, k, v)
    try:
        yield real
    finally:
        for k, v in real.items():
            setattr(tg, k, v)


def ddp_alive():
    return any(isinstance(o, DDP) for o in gc.get_objects())


def close_group():
    """Every worker's last act, as the trainer's own end (train: barrier, then main destroys the group):
    no rank tears the group down while the other is still in it. The worker's DDP wrapper must be gone first, as
    the trainer's is: freed after destroy_process_group, it destroys the gloo group while holding the GIL, and
    gloo's thread, which needs the GIL to free its last work, never joins (this suite hung there once)."""
    gc.collect()
    assert not ddp_alive(), "del the worker's DDP wrapper first"
    dist.barrier()
    dist.destroy_process_group()


def train(rank, world, argv, out_dir, bypass_ddp=False, tag="train"):
    """Run the real trainer on this rank; save what must agree across ranks."""
    original, tokenize = tg.completion_logps, tg.tokenize_prompts
    prompts_seen = []  # what this rank trained on, step by step (the loop is the only caller here)
    stand_ins = {"tokenize_prompts": lambda tok, prompts, *a, **k:
                 prompts_seen.append(sorted(set(prompts))) or tokenize(tok, prompts, *a, **k)}
    if bypass_ddp:  # the famous bug: the graph forward goes through model.module, skipping the all-reduce
        stand_ins["completion_logps"] = lambda model, *a, **k: original(tg.unwrap(model), *a, **k)
    with patched(**stand_ins):
        res = tg.main(argv)
    torch.save({"params": {k: v.clone() for k, v in res["model"].state_dict().items()}, "prompts": prompts_seen,
                "entropy_coef": res["entropy_coef"], "entropy_coef_applied": res["entropy_coef_applied"]},
               os.path.join(out_dir, f"{tag}_{rank}.pt"))


def teardown(rank, world, out_dir, argv, case):
    """The trainer's CLI on this rank, ending normally with its DDP wrapper caught in a reference cycle
    (case "cycle"), with a reward that raises (case "error"; the error, Python's own, leaves cli with a
    traceback that holds train's frame), or with a reward whose error has a context chain that loops (case
    "context_cycle"). Saves the exit status ("raised", with the error's type and notes, where cli raised) and
    whether a DDP wrapper was alive, uncollected, when main destroyed the group."""
    reward_file = os.path.join(out_dir, f"boom_{case}_{rank}.py")
    with open(reward_file, "w") as f:
        f.write("def boom(completions, **kwargs):\n")
        if case == "context_cycle":
            f.write("    a, b = ValueError('a'), ValueError('b')\n    a.__context__ = b\n    b.__context__ = a\n"
                    "    raise a\n")
        else:
            f.write("    raise ValueError('no')\n")
    alive = []
    real_destroy, real_wrap = dist.destroy_process_group, tg.wrap_ddp

    def destroy_process_group():
        alive.append(ddp_alive())
        real_destroy()

    def wrap_ddp(model, device):
        wrapped = real_wrap(model, device)
        wrapped.cycle = [wrapped]      # a reference cycle: only the garbage collector frees it
        return wrapped
    dist.destroy_process_group = destroy_process_group
    extra = ["--reward_funcs", f"{reward_file}:boom"] if case != "cycle" else []
    raised = None
    try:
        with patched(wrap_ddp=wrap_ddp if case == "cycle" else real_wrap):
            status = tg.cli(argv + extra)
    except Exception as e:                 # the reward's own error, as `python train_grpo.py` ends with it
        status, raised = "raised", [type(e).__name__, str(e), list(getattr(e, "__notes__", []))]
    finally:
        dist.destroy_process_group = real_destroy
    torch.save({"status": status, "raised": raised, "ddp_alive_at_destroy": alive},
               os.path.join(out_dir, f"{case}_{rank}.pt"))


# different data and different token counts per rank: rank 0 has 10 tokens of entropy ~0.1, rank 1 has 2 of ~0.5
def entropy_world(rank, world, out_dir, steps=6):
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(rank)
    coef, log = 0.0, []
    for step in range(steps):
        n = 10 if rank == 0 else 2
        ent = (0.1 if rank == 0 else 0.5) + 0.01 * step + 0.01 * torch.rand(3, 10, generator=g)
        mask = torch.zeros(3, 10)
        mask.view(-1)[:n] = 1
        local_sum, local_count = (ent * mask).sum().item(), mask.sum().item()
        h_w = tg.world_token_mean(local_sum, local_count)
        coef, applied = tg.update_entropy_coef(coef, h_w, target=0.2, delta=0.001, coef_min=0.0, coef_max=0.004)
        log.append({"sum": local_sum, "count": local_count, "coef": coef, "applied": applied})
    json.dump(log, open(os.path.join(out_dir, f"entropy_{rank}.json"), "w"))
    close_group()


def moe_empty_expert(rank, world, out_dir):
    """One MoE GRPO step under DDP where experts 2 and 3 receive no tokens on either rank."""
    dist.init_process_group("gloo")
    model, tok = tiny(use_moe=1, seed=0)
    used = set()
    for layer in model.model.layers:
        torch.nn.init.zeros_(layer.mlp.gate.weight)  # equal router logits: top-2 picks the same experts for every token
        layer.mlp.gate.register_forward_hook(lambda mod, inp, out: used.update(out[2].flatten().tolist()))
    ddp = DDP(model)
    input_ids, attn, comp, mask = sample_batch(model, tok, seed=rank)  # different prompts per rank
    used.clear()
    logps, _, aux = tg.completion_logps(ddp, input_ids, attn, comp.shape[1])
    adv = torch.randn(logps.shape[0], generator=torch.Generator().manual_seed(rank))
    loss, _ = tg.policy_objective(logps, logps.detach(), adv, mask, loss_type="grpo", epsilon=0.2, epsilon_high=0.2,
                           divisor=mask.shape[0])
    (loss + model.config.router_aux_loss_coef * aux).backward()
    router_grad = model.model.layers[0].mlp.gate.weight.grad.abs().sum().item()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    torch.save({"params": model.state_dict(), "used": sorted(used), "router_grad": router_grad},
               os.path.join(out_dir, f"moe_{rank}.pt"))
    del ddp
    close_group()


def batch_std_world(rank, world, out_dir):
    """--scale_rewards batch on 2 ranks with different rewards: both must divide by the std of the world batch."""
    dist.init_process_group("gloo")
    rewards = torch.tensor([[0.0, 1.0, 0.5, 0.5], [0.9, 1.0, 0.95, 1.0]][rank])  # one group of 4 per rank
    std = tg.world_std(rewards)
    adv = tg.compute_advantages(rewards, 4, "batch", std)
    torch.save({"rewards": rewards, "std": std, "adv": adv}, os.path.join(out_dir, f"batch_std_{rank}.pt"))
    close_group()


def loop_step_grads(rank, world, out_dir):
    """One real grpo_step under DDP with 2 micro-steps per rank and different prompts per rank. The optimizer
    step's pre-hook records the synced gradient it applies, saved with the rollout."""
    dist.init_process_group("gloo")
    train_rows, _ = tg.make_reverse_task(16)
    out = {}
    # Micro-batches of 4 hold one group each (S = 2 per rank); of 3, they split the groups (S = 3).
    for case, loss_type, micro in (("dapo", "dapo", 4), ("cispo", "cispo", 4), ("grpo", "grpo", 4),
                                   ("grpo, groups split", "grpo", 3)):
        model, tok = tiny(seed=0)
        ddp = DDP(model)
        args = tg.parse_args(["--loss_type", loss_type, "--batch_size", "2", "--num_generations", "4",
                              "--micro_batch_size", str(micro), "--grad_clip", "0"])
        optimizer, scheduler = tg.build_optimizer(model, args)
        seen = {}
        optimizer.register_step_pre_hook(
            lambda *_: seen.update(grads={n: p.grad.clone() for n, p in model.named_parameters()}))
        real = tg.rollout
        torch.manual_seed(rank)
        rows = train_rows[2 * rank:2 * rank + 2]                                  # different prompts per rank
        run = make_run(ddp, tok, optimizer, world, reward_fns=[tg.reverse_reward], weights=[1.0],
                       scheduler=scheduler)
        with patched(rollout=lambda *a, **k: seen.setdefault("rollout", (a[1], a[2], *real(*a, **k)))[2:]):
            tg.grpo_step(args, run, rows, tg.TrainState())[0]
        prompt_ids, prompt_mask, comp, mask, *_ = seen["rollout"]
        out[case] = {"grads": seen["grads"], "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                          "comp": comp, "mask": mask, "answers": [r["answer"] for r in rows for _ in range(4)]}
    torch.save(out, os.path.join(out_dir, f"loop_{rank}.pt"))
    del ddp, run
    close_group()


def warm_up_grads(rank, world, out_dir):
    """One supervised warm-up step of --sft_batch_size 3 on 2 ranks: the prompts this rank took and the gradient
    the clip saw (after DDP's all-reduce)."""
    dist.init_process_group("gloo")
    model, tok = tiny()
    seen, real_tokenize, real_clip = {}, tg.tokenize_prompts, tg.clip_grad_norm

    def tokenize(tok, prompts, *a, **k):
        seen["prompts"] = prompts
        return real_tokenize(tok, prompts, *a, **k)

    def clip(m, max_norm):
        seen["grads"] = {n: p.grad.clone() for n, p in m.named_parameters()}
        return real_clip(m, max_norm)
    args = tg.parse_args(["--sft_warmup_steps", "1", "--sft_batch_size", "3"])
    with patched(tokenize_prompts=tokenize, clip_grad_norm=clip):
        tg.sft_warmup(DDP(model), tok, tg.make_reverse_task(16)[0], args, "cpu", rank, world)
    torch.save(seen, os.path.join(out_dir, f"warm_{rank}.pt"))
    close_group()


def eval_uneven(rank, world, out_dir):
    """evaluate() on 5 held-out rows, batches of 2: rank 0 holds 3 rows (2 batches), rank 1 holds 2 (1 batch).
    The score of row i is i, so the world mean says whether each row was scored once."""
    dist.init_process_group("gloo")
    model, tok = tiny()
    rows = [{"prompt": "abc=", "answer": "cba", "i": i} for i in range(5)]
    scored = []

    def score(completions, i, **kwargs):
        scored.extend(i)
        return [float(x) for x in i]
    acc = evaluate_with(model, tok, rows, score, tg.Args(max_gen_len=2), rank, world, per_call=2)
    gathered = [None, None]
    dist.all_gather_object(gathered, scored)
    torch.save({"accuracy": acc, "scored": sorted(gathered[0] + gathered[1])},
               os.path.join(out_dir, f"eval_{rank}.pt"))
    close_group()


def fp16_skip(rank, world, out_dir, mode="ddp"):
    """--dtype float16 under DDP: step 1's gradient gets an inf on rank 1 only, before DDP's all-reduce (a hook
    on rank 1's gradient as backward makes it), so the all-reduce hands it to every rank; step 2 is clean.
    Saves whether this rank's weights moved, its loss scale, its skipped_updates and its final weights."""
    assert mode == "ddp", "FSDP is gone: DDP is the only wrapper"
    dist.init_process_group("gloo")
    model, tok = tiny()
    args = tg.parse_args(["--dtype", "float16", "--batch_size", "2", "--num_generations", "4"])
    wrapped = DDP(model)
    optimizer, _ = tg.build_optimizer(model, args)
    run = make_run(wrapped, tok, optimizer, world, fp16=True, reward_fns=[tg.reverse_reward], weights=[1.0])
    state = tg.TrainState()
    out = {"skipped_updates": []}
    train_rows, _ = tg.make_reverse_task(16)
    step = [1]

    def plant(grad):  # rank 1's own gradient, before it reaches DDP's bucket and the all-reduce
        if step[0] == 1 and rank == 1:
            grad = grad.clone()
            grad.view(-1)[0] = torch.inf
        return grad
    model.model.norm.weight.register_hook(plant)
    for step[0], tag in ((1, "after_inf"), (2, "after_good")):
        before = [p.detach().clone() for p in model.parameters()]
        torch.manual_seed(rank)
        tg.grpo_step(args, run, train_rows[2 * rank:2 * rank + 2], state)
        out[f"moved_{tag}"] = any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
        out[f"scale_{tag}"] = run.scaler.get_scale()
        out["skipped_updates"].append(state.skipped_updates)
    out["params"] = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(out, os.path.join(out_dir, f"fp16_{mode}_{rank}.pt"))
    del wrapped, run
    close_group()


def world_quantities(rank, world, out_dir):
    """Two real grpo_steps on 2 ranks with different rollouts and rewards (dapo, --scale_rewards batch,
    micro-batches of 2 rows, beta 0.04 against a reference that differs from the policy). The step's world
    numbers come from its own reductions, spied here, so a number computed on one rank shows. The policy is
    DDP-wrapped, as the trainer wraps it: step 2 gives rank 1 alone a NaN loss, which DDP's gradient all-reduce
    hands to rank 0 too. Saves what the step used, this rank's data, and an entropy and a k3 KL computed here by
    plain forwards."""
    dist.init_process_group("gloo")
    model, tok = tiny()
    with torch.no_grad():
        model.lm_head.weight.mul_(3)  # sharper logits: entropies that differ from token to token, rank to rank
    ref = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        ref.lm_head.weight.mul_(0.7)  # a reference that differs from the policy, so the KL is not 0
    G, P, T = 4, 4, 6
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, len(tok), (8, P + T), generator=g)
    mask = (torch.arange(T) < torch.tensor([[6, 5, 4, 3, 6, 2, 1, 6], [2, 2, 3, 1, 4, 6, 1, 3]][rank])[:, None]).long()
    rewards = torch.tensor([[1.0, 1, 1, 1, 0, 1, 0, 0], [0, 0.5, 1, 1, 0.2, 0, 0, 1]][rank])  # rank 0: 1 tied group
    am = torch.cat([torch.ones(8, P, dtype=torch.long), mask], 1)
    with torch.no_grad():  # the entropy of the policy that sampled, by a plain full forward
        positions = (am.cumsum(-1) - 1).clamp(min=0)
        z = model(ids, attention_mask=am, position_ids=positions).logits[:, P - 1:-1]
        logp = torch.log_softmax(z.double(), -1)
        ent = -(logp.exp() * logp).sum(-1)
        ref_z = ref(ids, attention_mask=am, position_ids=positions).logits[:, P - 1:-1]
        ref_logp = torch.log_softmax(ref_z.double(), -1)
        targets = ids[:, P:, None]
        delta = ref_logp.gather(-1, targets).squeeze(-1) - logp.gather(-1, targets).squeeze(-1)
        kl = torch.exp(delta) - delta - 1  # k3, by hand
    no_eos = mask.sum(1) == T  # the rows that ran to the end without an EOS
    seen = {"batch_std": [], "num_items": [], "local_loss": [], "local_policy_loss": [], "forwards": 0}
    real = {k: getattr(tg, k) for k in ("compute_advantages", "policy_objective", "loss_divisor", "completion_logps")}
    step = [1]

    def compute_advantages(rewards, G, scale, batch_std):
        seen["batch_std"].append(batch_std)
        adv = real["compute_advantages"](rewards, G, scale, batch_std)
        if step[0] == 2 and rank == 1:
            adv[-1] = float("nan")                                # rank 1's loss alone is not finite
        return adv

    def loss_divisor(loss_type, rows, S, N, *a):
        seen["num_items"].append(N)
        return real["loss_divisor"](loss_type, rows, S, N, *a)

    def policy_objective(*a, **k):
        loss, stats = real["policy_objective"](*a, **k)
        seen["local_loss"].append(loss.item())
        seen["local_policy_loss"].append(stats["policy_loss"].item())
        return loss, stats

    def completion_logps(*a, **k):
        seen["forwards"] += step[0] == 1 and torch.is_grad_enabled()
        return real["completion_logps"](*a, **k)
    stand_ins = dict(compute_advantages=compute_advantages, policy_objective=policy_objective, completion_logps=completion_logps,
                     loss_divisor=loss_divisor, tokenize_prompts=lambda *a, **k: (ids[:, :P], am[:, :P], rank + 1),
                     rollout=lambda *a, **k: (ids[:, P:], mask, no_eos),
                     score_completions=lambda *a, **k: torch.zeros(8, 0, dtype=torch.float64),
                     compute_rewards=lambda *a, **k: rewards.clone())
    args = tg.parse_args(["--loss_type", "dapo", "--scale_rewards", "batch", "--batch_size", "2",
                          "--num_generations", str(G), "--micro_batch_size", "2", "--beta", "0.04"])
    optimizer, scheduler = tg.build_optimizer(model, args)
    run = make_run(DDP(model), tok, optimizer, world, scheduler=scheduler)
    run.ref_model = ref
    state = tg.TrainState()
    with patched(**stand_ins):
        record, _ = tg.grpo_step(args, run, [{"prompt": ""}] * 2, state)
        out = {"world_entropy": state.world_entropy, "skipped_after_1": state.skipped_updates,
               "record": {k: v for k, v in record.items() if isinstance(v, (int, float))}}
        before = [p.detach().clone() for p in model.parameters()]
        step[0] = 2
        tg.grpo_step(args, run, [{"prompt": ""}] * 2, state)
    out.update(seen, moved_in_2=any(not torch.equal(b, p) for b, p in zip(before, model.parameters())),
               skipped_after_2=state.skipped_updates, rewards=rewards.tolist(), tokens=mask.sum().item(),
               rows=mask.shape[0], ent_sum=(ent * mask).sum().item(), ent_count=mask.sum().item(),
               kl_sum=(kl * mask).sum().item(), no_eos=no_eos.sum().item(), cut=rank + 1)
    torch.save(out, os.path.join(out_dir, f"world_{rank}.pt"))
    del run
    close_group()
