"""Functions run in 2 spawned gloo processes (they must live in an importable module)."""
import json
import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
import torch.distributed as dist

from helpers import make_run, sample_batch, step_on_batch, tg, tiny


def close_group():
    """Every worker's last act, as the trainer's own end (train: barrier, then main destroys the group):
    no rank tears the group down while the other is still in it."""
    dist.barrier()
    dist.destroy_process_group()


def train(rank, world, argv, out_dir, bypass_ddp=False):
    """Run the real trainer on this rank; save what must agree across ranks."""
    if bypass_ddp:  # the famous bug: the graph forward goes through model.module, skipping the all-reduce
        original = tg.completion_logps
        tg.completion_logps = lambda model, *a, **k: original(tg.unwrap(model), *a, **k)
    prompts_seen = []  # what this rank trained on, step by step (the loop is the only caller here)
    tokenize = tg.tokenize_prompts
    tg.tokenize_prompts = lambda tok, prompts, *a, **k: prompts_seen.append(sorted(set(prompts))) or tokenize(tok, prompts, *a, **k)
    res = tg.main(argv)
    torch.save({"params": {k: v.clone() for k, v in res["model"].state_dict().items()}, "prompts": prompts_seen,
                "entropy_coef": res["c"], "entropy_coef_applied": res["alpha"]},
               os.path.join(out_dir, f"rank{rank}.pt"))


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
        h_w = tg.world_mean(local_sum, local_count)
        coef, applied = tg.update_entropy_coef(coef, h_w, target=0.2, delta=0.001, coef_min=0.0, coef_max=0.004)
        log.append({"sum": local_sum, "count": local_count, "coef": coef, "applied": applied})
    json.dump(log, open(os.path.join(out_dir, f"rank{rank}.json"), "w"))
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
    loss, _ = tg.grpo_loss(logps, logps.detach(), adv, mask, loss_type="grpo", epsilon=0.2, epsilon_high=0.2,
                           divisor=mask.shape[0])
    (loss + model.config.router_aux_loss_coef * aux).backward()
    router_grad = model.model.layers[0].mlp.gate.weight.grad.abs().sum().item()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    torch.save({"params": model.state_dict(), "used": sorted(used), "router_grad": router_grad},
               os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


def batch_std_world(rank, world, out_dir):
    """--scale_rewards batch on 2 ranks with different rewards: both must divide by the std of the world batch."""
    dist.init_process_group("gloo")
    rewards = torch.tensor([[0.0, 1.0, 0.5, 0.5], [0.9, 1.0, 0.95, 1.0]][rank])  # one group of 4 per rank
    std = tg.world_std(rewards)
    adv = tg.compute_advantages(rewards, 4, "batch", std)
    torch.save({"rewards": rewards, "std": std, "adv": adv}, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


def loop_step_grads(rank, world, out_dir):
    """One real grpo_step under DDP with 2 micro-steps per rank and different prompts per rank. The optimizer
    step's pre-hook records the synced gradient it applies, saved with the rollout."""
    dist.init_process_group("gloo")
    train_rows, _ = tg.make_reverse_task(16)
    out = {}
    for loss_type in ("dapo", "cispo", "grpo"):
        model, tok = tiny(seed=0)
        ddp = DDP(model)
        args = tg.parse_args(["--loss_type", loss_type, "--batch_size", "2", "--num_generations", "4",
                              "--micro_batch_size", "4", "--grad_clip", "0"])   # S = 2 micro-steps per rank
        optimizer, scheduler = tg.build_optimizer(model, args)
        seen = {}
        optimizer.register_step_pre_hook(
            lambda *_: seen.update(grads={n: p.grad.clone() for n, p in model.named_parameters()}))
        real = tg.rollout
        tg.rollout = lambda *a, **k: seen.setdefault("rollout", (a[1], a[2], *real(*a, **k)))[2:]
        torch.manual_seed(rank)
        rows = train_rows[2 * rank:2 * rank + 2]                                  # different prompts per rank
        run = make_run(ddp, tok, optimizer, world, reward_fns=[tg.reverse_reward], weights=[1.0],
                       scheduler=scheduler)
        tg.grpo_step(args, run, rows, tg.TrainState())
        tg.rollout = real
        prompt_ids, prompt_mask, comp, mask, *_ = seen["rollout"]
        out[loss_type] = {"grads": seen["grads"], "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                          "comp": comp, "mask": mask, "answers": [r["answer"] for r in rows for _ in range(4)]}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


def train_and_capture(rank, world, runs, out_dir):
    """Run the real trainer once per (tag, argv) on this rank, one process group each. Saves the gradient the
    first optimizer step receives (full tensors, also under FSDP), the final full weights (rank 0), how many
    parameter elements this rank holds, and how often a graph forward went through the root module's __call__."""
    import copy
    for tag, argv in runs:
        grads, root_calls = [], [0]
        real_step = torch.optim.AdamW.step

        def step(self, *a, **k):
            if not grads:
                grads.append([(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                              for p in self.param_groups[0]["params"]])
            return real_step(self, *a, **k)
        torch.optim.AdamW.step = step
        real_load = tg.load_model_and_tokenizer

        def load(args, device):  # count the root's forwards in grad mode: the loss must go through its hooks
            model, tok = real_load(args, device)
            model.register_forward_pre_hook(lambda m, a: root_calls.__setitem__(0, root_calls[0] + torch.is_grad_enabled()))
            return model, tok
        full, real_finish = {}, tg.finish

        def finish(args, policy, *a, **k):  # every rank calls it while the group is up: gather the weights
            full.update(tg.full_state_dict(policy))
            return real_finish(args, policy, *a, **k)
        tg.load_model_and_tokenizer, tg.finish = load, finish
        try:
            res = tg.main(copy.copy(argv) + ["--save_dir", os.path.join(out_dir, tag)])
        finally:
            torch.optim.AdamW.step, tg.load_model_and_tokenizer, tg.finish = real_step, real_load, real_finish
        model = res["model"]
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
        torch.save({"grads": grads[0], "params": {k: v.clone() for k, v in full.items()}, "local": local,
                    "total": sum(p.numel() for p in model.parameters()), "root_calls": root_calls[0],
                    "fsdp": tg.is_fsdp(model)}, os.path.join(out_dir, f"{tag}_rank{rank}.pt"))


def micro_batch_world(rank, world, out_dir):
    """auto micro-batches on 2 ranks whose batches differ in width (50 vs 150 tokens): one count for both."""
    dist.init_process_group("gloo")
    args = tg.Args(model_name_or_path="a-real-model", micro_batch_tokens=200, num_generations=4)
    seen = []
    real = tg.completion_logps

    def count(model, input_ids, *a, **k):
        seen.append(input_ids.shape[0])
        return real(model, input_ids, *a, **k)
    tg.completion_logps = count
    model, tok = tiny()
    width = [50, 150][rank]
    ids = torch.randint(3, len(tok), (4, width))
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), mask=torch.ones(4, 6),
                 advantages=torch.ones(4), sampler_logps=torch.zeros(4, 6))
    ddp = DDP(model)
    step_on_batch(args, make_run(ddp, tok, torch.optim.SGD(model.parameters(), lr=0.0), world=world), batch)
    tg.completion_logps = real
    torch.save(seen[0], os.path.join(out_dir, f"micro_{rank}.pt"))
    close_group()


def eval_uneven(rank, world, out_dir):
    """evaluate() on 5 held-out rows, batches of 2: rank 0 holds 3 rows (2 batches), rank 1 holds 2 (1 batch).
    The score of row i is i, so the world mean says whether each row was scored once."""
    dist.init_process_group("gloo")
    model, tok = tiny()
    rows = [{"prompt": "abc=", "answer": "cba", "i": i} for i in range(5)]
    scored = []

    def score(texts, rows, ids):
        scored.extend(r["i"] for r in rows)
        return [float(r["i"]) for r in rows]
    acc = tg.evaluate(model, tok, rows, score, tg.Args(max_gen_len=2), rank, world, "cpu", batch=2)
    gathered = [None, None]
    dist.all_gather_object(gathered, scored)
    torch.save({"accuracy": acc, "scored": sorted(gathered[0] + gathered[1])},
               os.path.join(out_dir, f"eval_{rank}.pt"))
    close_group()


def fp16_skip(rank, world, out_dir, mode="ddp"):
    """--dtype float16 under DDP or FSDP: step 1's gradient gets an inf on rank 1 only (after DDP's
    all-reduce; under FSDP in rank 1's own shard); step 2 is clean. Saves whether this rank's weights
    moved and its loss scale."""
    dist.init_process_group("gloo")
    model, tok = tiny()
    args = tg.parse_args(["--dtype", "float16", "--batch_size", "2", "--num_generations", "4",
                          "--fsdp", str(int(mode == "fsdp"))])
    wrapped = tg.shard_fsdp(model, args, world) if mode == "fsdp" else DDP(model)
    optimizer, _ = tg.build_optimizer(model, args)
    run = make_run(wrapped, tok, optimizer, world, fp16=True, reward_fns=[tg.reverse_reward], weights=[1.0])
    state, real = tg.TrainState(), run.scaler.unscale_
    out = {"bad_in_a_row": [], "skipped_steps": []}
    train_rows, _ = tg.make_reverse_task(16)
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # FSDP: this rank's shard
    for step, tag in ((1, "after_inf"), (2, "after_good")):
        def plant(optimizer):  # after backward (and DDP's all-reduce), before the step unscales
            if step == 1 and rank == 1:
                local(next(p for p in model.parameters() if p.grad is not None).grad).view(-1)[0] = torch.inf
            return real(optimizer)
        run.scaler.unscale_ = plant
        before = [local(p.detach()).clone() for p in model.parameters()]
        torch.manual_seed(rank)
        tg.grpo_step(args, run, train_rows[2 * rank:2 * rank + 2], state)
        out[f"moved_{tag}"] = any(not torch.equal(b, local(p.detach())) for b, p in zip(before, model.parameters()))
        out[f"scale_{tag}"] = run.scaler.get_scale()
        out["bad_in_a_row"].append(state.bad_in_a_row)
        out["skipped_steps"].append(state.skipped_steps)
    out["params"] = {k: v.clone() for k, v in tg.full_state_dict(wrapped, every_rank=True).items()}
    torch.save(out, os.path.join(out_dir, f"fp16_{mode}_{rank}.pt"))
    close_group()


def world_quantities(rank, world, out_dir):
    """Two real grpo_steps on 2 ranks with different rollouts and rewards (dapo, --scale_rewards batch, zero-
    advantage rows skipped, micro-batches of 2 rows). The policy is not wrapped in DDP: only the step's own world
    reductions tie the ranks, so a number computed on one rank shows. Step 2 gives rank 1 alone a NaN loss.
    Saves what the step used (spied), this rank's data, and an entropy computed here by a plain forward."""
    dist.init_process_group("gloo")
    model, tok = tiny()
    with torch.no_grad():
        model.lm_head.weight.mul_(3)  # sharper logits: entropies that differ from token to token, rank to rank
    G, P, T = 4, 4, 6
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, len(tok), (8, P + T), generator=g)
    mask = (torch.arange(T) < torch.tensor([[6, 5, 4, 3, 6, 2, 1, 6], [2, 2, 3, 1, 4, 6, 1, 3]][rank])[:, None]).long()
    rewards = torch.tensor([[1.0, 1, 1, 1, 0, 1, 0, 0], [0, 0.5, 1, 1, 0.2, 0, 0, 1]][rank])  # rank 0: 1 tied group
    trained = (rewards.view(-1, G).amax(1) != rewards.view(-1, G).amin(1)).repeat_interleave(G)  # A != 0
    am = torch.cat([torch.ones(8, P, dtype=torch.long), mask], 1)
    with torch.no_grad():  # the entropy of the policy that sampled, by a plain full forward
        z = model(ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits[:, P - 1:-1]
        logp = torch.log_softmax(z.double(), -1)
        ent = -(logp.exp() * logp).sum(-1)
    seen = {"batch_std": [], "num_items": [], "local_loss": [], "most_kept": [], "forwards": 0}
    real = {k: getattr(tg, k) for k in ("compute_advantages", "grpo_loss", "loss_divisor", "world_max",
                                        "completion_logps")}
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

    def grpo_loss(*a, **k):
        loss, stats = real["grpo_loss"](*a, **k)
        seen["local_loss"].append(loss.item())
        return loss, stats

    def world_max(*a, **k):  # the step's (widest, most kept); sampler_mismatch's take 3 values
        out = real["world_max"](*a, **k)
        if len(a) == 2:
            seen["most_kept"].append(out[1])
        return out

    def completion_logps(*a, **k):
        seen["forwards"] += step[0] == 1 and torch.is_grad_enabled()
        return real["completion_logps"](*a, **k)
    stand_ins = dict(compute_advantages=compute_advantages, grpo_loss=grpo_loss, completion_logps=completion_logps,
                     loss_divisor=loss_divisor, world_max=world_max,
                     tokenize_prompts=lambda *a, **k: (ids[:, :P], am[:, :P], 0),
                     rollout=lambda *a, **k: (ids[:, P:], mask, torch.zeros(8, dtype=torch.bool), torch.zeros(8, T)),
                     decode_completions=lambda *a: [""] * 8, compute_rewards=lambda *a: rewards.clone())
    for k, v in stand_ins.items():
        setattr(tg, k, v)
    args = tg.parse_args(["--loss_type", "dapo", "--scale_rewards", "batch", "--batch_size", "2",
                          "--num_generations", str(G), "--micro_batch_size", "2"])
    optimizer, scheduler = tg.build_optimizer(model, args)
    run = make_run(model, tok, optimizer, world, scheduler=scheduler)
    state = tg.TrainState()
    tg.grpo_step(args, run, [{"prompt": ""}] * 2, state)
    out = {"world_entropy": state.world_entropy, "skipped_after_1": state.skipped_steps}
    before = [p.detach().clone() for p in model.parameters()]
    step[0] = 2
    tg.grpo_step(args, run, [{"prompt": ""}] * 2, state)
    out.update(seen, moved_in_2=any(not torch.equal(b, p) for b, p in zip(before, model.parameters())),
               skipped_after_2=state.skipped_steps, rewards=rewards.tolist(), tokens=mask.sum().item(),
               kept=int(trained.sum()), ent_sum=(ent * mask)[trained].sum().item(),
               ent_count=mask[trained].sum().item())
    torch.save(out, os.path.join(out_dir, f"world_{rank}.pt"))
    close_group()


def fsdp_old_logps_keep_one_hidden_state(rank, world, out_dir):
    """--fsdp 1 --num_iterations 2 on 2 ranks fed different rollouts: the no-grad pass that scores the old
    log-probs (grpo_step's completion_logps without grad). Saves what its forwards were asked for and returned, how many decoder
    layers' outputs were alive when the final norm ran, and the old log-probs next to a plain full-logits
    forward's."""
    import weakref
    dist.init_process_group("gloo")
    model, tok = tiny(seed=0)
    input_ids, attn, comp, mask = sample_batch(model, tok, seed=rank)
    with torch.no_grad():  # independent: every position's logits from the unsharded model, then log-softmax
        T = comp.shape[1]
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids, attention_mask=attn, position_ids=pos).logits[:, -T - 1:-1]
        want = torch.log_softmax(logits.double(), -1).gather(-1, comp[..., None]).squeeze(-1)
    args = tg.parse_args(["--fsdp", "1", "--num_iterations", "2"])
    wrapped = tg.shard_fsdp(model, args, world)
    asked, returned, layer_outputs, alive = [], [], [], []
    wrapped.register_forward_pre_hook(lambda m, a, k: asked.append(bool(k.get("output_hidden_states"))),
                                      with_kwargs=True)
    wrapped.register_forward_hook(lambda m, a, out: returned.append(getattr(out, "hidden_states", None) is not None))
    for layer in model.model.layers:
        layer.register_forward_hook(lambda m, a, out: layer_outputs.append(
            weakref.ref(out[0] if isinstance(out, tuple) else out)))
    model.model.norm.register_forward_pre_hook(
        lambda m, a: alive.append(sum(r() is not None for r in layer_outputs)) or layer_outputs.clear())
    kept = torch.arange(input_ids.shape[0])
    with torch.no_grad():
        old = tg.completion_logps(wrapped, input_ids[kept], attn[kept], T, with_entropy=False,
                                  chunk_size=args.logp_chunk_size, **tg.scored_distribution(args))[0]
    torch.save({"asked": asked, "returned": returned, "alive": alive, "old": old, "want": want, "mask": mask},
               os.path.join(out_dir, f"old_{rank}.pt"))
    close_group()
