"""GRPO in one file: rollout -> reward -> advantage -> log-probs -> loss -> update, then the loop.

One step (`grpo_step`), in the stages of the README's "The math", each a labelled block there:
  1. Prompts: B per rank, each repeated G times (a group), left-padded, left-truncated.
  2. Rollout: G completions per prompt (`model.generate`) and the sampler's log-prob of each token.
  3. Reward: plain-Python rewards, per sample or TRL's batched form (None: does not apply).
  4. Advantage: A = (r - mean of its group) / (std of its group + 1e-4). No value network.
  5-6. Reference (beta > 0) and old (mu > 1) log-probs: detached tensors, no graph.
  7. Current log-probs: a fresh forward through the DDP wrapper, lm_head in chunks ([rows, T, vocab]
     logits never exist); top-k/top-p: under the truncation that sampled.
  8. The per-token objective: the clipped ratio (per token, or per sequence: GSPO) or cispo's
     capped-weight REINFORCE, + beta k3 KL.
  9. Normalization: grpo, bnpo, dr_grpo, dapo (cispo: dapo's).
  10-11. Entropy: logged without a graph; an optional bonus whose adaptive coefficient is one
     world number, set after the update for the next step.
  12. MoE: the router's load-balancing loss.
  13. Update: backward over micro-batches, clip, AdamW (fp32 master weights, compute in --dtype,
     fp16 with loss scaling), then the learning-rate schedule.
  14. Log (and, in the loop, save).
With the defaults (mu = 1, beta = 0, no bonus) the ratio is exactly 1 and never clips: REINFORCE
with the group mean as baseline. Rows whose advantage is 0 skip their forwards and backward where
that leaves the update as it is (README: Work without a gradient).

    python train_grpo.py                                        # offline: tiny model, built-in task
    torchrun --nproc_per_node 2 train_grpo.py --loss_type grpo  # 2 processes (gloo CPU, nccl GPU)
    python train_grpo.py --model_name_or_path HuggingFaceTB/SmolLM2-135M-Instruct \\
        --dataset compare_numbers                               # or the .gguf file (README)

Read it top to bottom beside notebook.ipynb: Args, the step, then the helpers in the order it first
calls them (lr_factor: what the scheduler applies); below a PLUMBING banner, what runs the step (the
loop, flags, data, models, processes, checkpoints, reporting). Every formula has a test in tests/.
"""

import argparse
import dataclasses
import functools
import glob
import importlib.util
import inspect
import json
import math
import os
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DistributedSampler
from tqdm import tqdm

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")

# --- Config: every field is a flag `--name value`; --help shows its text and default --------------
def flag(default, help, **kw):
    return field(default=default, metadata={"help": help, **kw})

@dataclass
class Args:
    # what to train
    loss_type: str = flag("grpo", "normalization (README: The math, stage 9)", choices=LOSS_TYPES)
    use_moe: int = flag(0, "1: an MoE model (tiny Qwen3-MoE; a given one checked)", choices=(0, 1))
    model_name_or_path: str = flag("", "hub name, local dir or .gguf file; empty: a tiny model")
    dataset: str = flag("", "compare_numbers (built-in, for instruct models), gsm8k, a hub "
                        "dataset or a .jsonl/.json/.parquet file; empty: the reversal task")
    question_field: str = flag("question", "question column (GSM8K's system prompt; over 'prompt')")
    answer_field: str = flag("answer", "column of the reference answer (optional with 'prompt')")
    reward_funcs: str = flag("", "file.py:name or built-in names, by commas: f(completion, **row) "
                             "-> float or None, or TRL's batched form; empty: the task's own")
    reward_weights: str = flag("", "comma-separated; empty: task's own (1 each for --reward_funcs)")
    trust_remote_code: int = flag(0, "1: let from_pretrained run the model's code", choices=(0, 1))
    # rollout
    num_generations: int = flag(8, "G: completions sampled per prompt (a group)")
    batch_size: int = flag(16, "B: prompts per rank per step (so B*G rows)")
    micro_batch_size: int = flag(0, "rows per forward/backward; 0: auto, --micro_batch_tokens")
    micro_batch_tokens: int = flag(16384, "auto micro-batches: at most rows x length tokens")
    max_prompt_len: int = flag(256, "prompt tokens kept (longer prompts are left-truncated)")
    max_gen_len: int = flag(8, "L_max: new tokens per completion")
    temperature: float = flag(1.0, "sampling temperature (log-probs use the same one)")
    top_p: float = flag(1.0, "nucleus sampling threshold")
    top_k: int = flag(0, "top-k sampling; 0: off")
    mask_truncated_completions: int = flag(0, "1: mask completions without EOS", choices=(0, 1))
    # objective
    beta: float = flag(0.0, "k3 KL coefficient; > 0 builds a frozen reference model")
    epsilon: float = flag(0.2, "lower clip: ratio >= 1 - epsilon")
    epsilon_high: float = flag(-1.0, "upper clip (cispo: weight cap); -1: epsilon (cispo: 5.0)")
    num_iterations: int = flag(1, "mu: updates per rollout (old log-probs computed once)")
    scale_rewards: str = flag("group", "advantage divisor: group std, batch std or none",
                              choices=("group", "batch", "none"))
    importance_sampling_level: str = flag("token", "ratio per token or per sequence (GSPO: exp("
                                          "mean logp - old); not cispo)",
                                          choices=("token", "sequence"))
    # log-probs and entropy (README: The math, stages 7, 10-11)
    logp_chunk_size: int = flag(0, "tokens per lm_head chunk for log-probs; 0: auto (64 MiB fp32)")
    entropy_coef: float = flag(0.0, "entropy bonus alpha (< 0 lowers entropy); adaptive: c's start")
    use_adaptive_entropy: int = flag(0, "1: adapt c to hold the entropy at --entropy_target",
                                     choices=(0, 1))
    entropy_target: float = flag(0.2, "adaptive: target world entropy (nats per token)")
    entropy_coef_delta: float = flag(1e-4, "adaptive: coefficient change per GRPO step")
    entropy_coef_min: float = flag(0.0, "adaptive: lower bound of the coefficient")
    entropy_coef_max: float = flag(0.005, "adaptive: upper bound of the coefficient")
    # optimization
    max_steps: int = flag(200, "GRPO steps (each makes --num_iterations optimizer updates)")
    learning_rate: float = flag(2e-4, "AdamW learning rate of the GRPO updates")
    weight_decay: float = flag(0.0, "AdamW weight decay")
    lr_scheduler: str = flag("constant", "after linear warmup", choices=("constant", "cosine"))
    warmup_steps: int = flag(0, "linear learning-rate warmup steps")
    grad_clip: float = flag(1.0, "max global grad norm; 0: no clipping (the norm is still logged)")
    skip_zero_advantage_rows: int = flag(1, "1: zero-advantage rows skip forward/backward (same "
                                         "update; off under beta/entropy/MoE/bnpo)", choices=(0, 1))
    gradient_checkpointing: int = flag(-1, "1: recompute layers in backward; -1: on with "
                                       "--model_name_or_path, else off", choices=(-1, 0, 1))
    sft_warmup_steps: int = flag(200, "built-in task only: supervised steps before eval and GRPO")
    sft_learning_rate: float = flag(1e-3, "learning rate of the supervised warmup")
    # bookkeeping
    seed: int = flag(0, "seed for model init, data order and sampling")
    save_dir: str = flag("runs/grpo", "metrics.jsonl, checkpoints and the final model go here")
    save_interval: int = flag(0, "write checkpoint-<step> every N steps; 0: only at the end")
    resume: str = flag("", "'auto' (latest checkpoint in save_dir) or a checkpoint dir")
    eval_interval: int = flag(50, "held-out greedy eval every N steps, and before/after; 0: off")
    eval_size: int = flag(256, "held-out prompts (a file without a test split: its first rows)")
    dtype: str = flag("float32", "compute dtype under autocast (weights and AdamW state stay "
                      "float32)", choices=("float32", "bfloat16", "float16"))
    cast_lm_head_to_fp32: int = flag(0, "1: fp32 lm_head under bf16/fp16, not FSDP", choices=(0, 1))
    fsdp: int = flag(0, "1: shard weights, gradients, AdamW state (FSDP2); 0: DDP", choices=(0, 1))
    rollout_cache: str = flag("auto", "generate's KV cache: static (compiled decode), dynamic, or "
                              "auto (static on CUDA)", choices=("auto", "static", "dynamic"))
    device: str = flag("auto", "auto, cpu, cuda", choices=("auto", "cpu", "cuda"))
    stop_after: int = flag(0, "stop (as if interrupted) after this step; 0: run to max_steps")
    report_to: str = flag("none", "also log each step", choices=("none", "wandb", "tensorboard"))
    run_name: str = flag("", "name of the run in wandb/tensorboard; empty: the save_dir's name")

    def __post_init__(self):  # whoever builds an Args (parse_args, a test, a fork) gets the rule
        if self.epsilon_high == -1.0:
            self.epsilon_high = default_epsilon_high(self.loss_type, self.epsilon)

# A task's own sizes replace Args' defaults (a flag typed wins): compare_numbers, for a 2-core CPU
TASK_DEFAULTS = {"compare_numbers": dict(batch_size=4, num_generations=8, max_gen_len=8,
                                         max_prompt_len=128, learning_rate=2e-5, max_steps=40,
                                         eval_interval=10, eval_size=200)}

def default_epsilon_high(loss_type, epsilon):
    # -1: the upper offset (ratio <= 1 + eps_h) is epsilon; cispo's cap (min(r, eps_h)) is 5.0
    return 5.0 if loss_type == "cispo" else epsilon

# ==================================================================================================
# THE ALGORITHM: the step (stages 1-14), then the helpers in the order it first calls them.
# ==================================================================================================

# --- The step: every stage a labelled block, in order ---------------------------------------------
@dataclass
class TrainState:
    """Everything the loop carries from one step to the next (all of it goes into a checkpoint)."""
    step: int = 0
    sampler_epoch: int = 0
    sampler_pos: int = 0
    c: float = 0.0                     # the adaptive entropy coefficient (or the static alpha)
    alpha: float = 0.0                 # the entropy bonus coefficient the next step's loss applies
    world_entropy: float = float("nan")  # of the rows trained on (all of them when adaptive)
    skipped_steps: int = 0             # optimizer updates skipped (loss or grad norm not finite)
    bad_in_a_row: int = 0              # steps in a row with a skip the loss scale could not cure
    truncated_prompts: int = 0         # prompts left-truncated so far, all ranks

    @classmethod
    def initial(cls, args):
        # adaptive: c starts at --entropy_coef, alpha at 0 until a world entropy is measured (TRL)
        return cls(c=args.entropy_coef,
                   alpha=0.0 if args.use_adaptive_entropy else args.entropy_coef)

@dataclass
class Trainer:
    """The trainer grpo_step runs on, built once by train(): the models, reward functions, and the
    optimizer with its schedule and loss scaler (whose states change as it trains)."""
    model: torch.nn.Module       # the policy as the loss sees it (DDP wrapper or FSDP); no dropout
    ref_model: object            # beta > 0: a frozen copy of the policy as GRPO starts, else None
    optimizer: object
    scheduler: object            # the learning-rate schedule (lr_factor)
    scaler: object               # torch.amp.GradScaler: loss scaling under fp16, else inert
    tokenizer: object
    reward_fns: list
    weights: list
    world: int = 1               # ranks (dapo's divisor: N / world)
    device: str = "cpu"

def grpo_step(args, trainer, prompt_rows, state):
    """One step on this rank's B prompts: updates `state` in place, returns the metrics (world)."""
    G, policy, device = args.num_generations, unwrap(trainer.model), trainer.device
    lr, log = trainer.scheduler.get_last_lr()[0], StepLog(device)  # log: 14's timing and sums
    # 1. prompts, each repeated G times (a group, contiguous); left-padded, left-truncated (n_cut)
    prompt_ids, prompt_mask, n_cut = tokenize_prompts(
        trainer.tokenizer, [r["prompt"] for r in prompt_rows], args.max_prompt_len, device, G)
    rows = [r for r in prompt_rows for _ in range(G)]                  # B*G rows; ids [rows, P]
    # 2. rollout, no graph: m = 1 up to the first EOS (included); the sampler's log-prob per token
    with autocast(args, device), log:  # `with log`: the rollout's time
        completion_ids, mask, no_eos, sampler_logps = rollout(                # [rows, T]
            policy, prompt_ids, prompt_mask, trainer.tokenizer, max_gen_len=args.max_gen_len,
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            static_cache=use_static_cache(args, device))
    # 3. reward of the completion as generated: r_i = sum_k w_k reward_k(o_i), None skipped
    ids = completion_token_ids(completion_ids, mask)                    # TRL's completion_ids
    completions = decode_completions(trainer.tokenizer, ids, rows)
    rewards = compute_rewards(trainer.reward_fns, trainer.weights, completions, rows, ids)  # [rows]
    # 4. advantage A_i = (r_i - mean_group) / (std_group + 1e-4); batch: all ranks' reward std
    batch_std = world_std(rewards, device) if args.scale_rewards == "batch" else None
    advantages = compute_advantages(rewards, G, args.scale_rewards, batch_std).to(device)  # [rows]
    if args.mask_truncated_completions:  # no EOS: the reward stands, the tokens count for nothing
        mask = mask * (~no_eos).unsqueeze(1)
    input_ids = torch.cat([prompt_ids, completion_ids], 1)                       # [rows, P + T]
    attention_mask = torch.cat([prompt_mask, mask], 1)
    T, alpha = completion_ids.shape[1], state.alpha
    score = dict(scored_distribution(args), chunk_size=args.logp_chunk_size)  # how logps are scored
    kept = rows_to_train(args, trainer, advantages, mask, alpha)  # [kept]: A != 0 where exact
    widest, most_kept = world_max(input_ids.shape[1], len(kept), device=device)  # all ranks'
    # 5-6. reference (beta > 0) and old (mu > 1) log-probs of the kept rows, no graph (FSDP: its
    # forward gathers, a collective: a rank with no row scores a stand-in while another scores)
    idx = kept.new_zeros(1) if is_fsdp(trainer.model) and most_kept and not len(kept) else kept
    with torch.no_grad(), autocast(args, device):  # [kept, T], or None
        ref_logps, old_logps = (None if m is None or not len(idx) else completion_logps(
            m, input_ids[idx], attention_mask[idx], T, with_entropy=False, **score)[0]
            for m in (trainer.ref_model, trainer.model if args.num_iterations > 1 else None))
    N = world_sum(mask.sum().item(), device=device)[0]   # masked tokens, all ranks
    # S micro-batches of kept rows on every rank: as the rank keeping most needs (0: none keeps one)
    micro = args.micro_batch_size or auto_micro_batch(len(rows), widest, args)
    S = math.ceil(most_kept / micro)
    D = loss_divisor(args.loss_type, len(rows), S, N, trainer.world, args.max_gen_len)  # stage 9
    applied, in_a_row, state.bad_in_a_row = False, state.bad_in_a_row, 0  # any bad update: failing
    for it in range(args.num_iterations):  # mu updates per rollout
        totals = log.new_update(len(kept))  # this update's sums over its micro-batches
        for j in range(S):
            part = slice(j * micro, (j + 1) * micro)
            stand_in = len(kept[part]) == 0  # this rank is out of rows: one row, loss 0 x logp
            idx = kept.new_zeros(1) if stand_in else kept[part]
            sync_gradients(trainer.model, j == S - 1)  # DDP/FSDP reduce on the last only
            # 7. logp_t = z_t[o_t] - logsumexp(z_t) through the wrapper (its forward syncs grads); H
            # of the first update (the policy that sampled), in the graph only if a bonus uses it
            with autocast(args, device):
                logps, entropy, aux = completion_logps(                           # [micro, T]
                    trainer.model, input_ids[idx], attention_mask[idx], T, **score,
                    entropy_grad=alpha != 0.0, with_entropy=it == 0 or alpha != 0.0)
            if stand_in:  # the backward (and DDP's all-reduce) still runs, adding exactly 0
                zero_gradient_without_rows(trainer, logps)
                continue
            # on-policy old = sg(logp): ratio 1, gradient dlogp (exp(x - x) in the graph: 0)
            old = logps.detach() if old_logps is None else old_logps[part]
            # 8-11. L = clipped ratio objective + beta KL - alpha H, sum L m / D (per --loss_type)
            loss, stats = grpo_loss(
                logps, old, advantages[idx], mask[idx], loss_type=args.loss_type,
                epsilon=args.epsilon, epsilon_high=args.epsilon_high, divisor=D,
                ref_logps=None if ref_logps is None else ref_logps[part], beta=args.beta,
                entropy=entropy, alpha=alpha,
                importance_sampling_level=args.importance_sampling_level)
            # 12. MoE: the router's load-balancing loss, times the config's coefficient
            if aux is not None:
                loss = loss + policy.config.router_aux_loss_coef * aux / S
            # 13. backward: gradients add up over micro-batches (fp16: loss x scale, no underflow)
            trainer.scaler.scale(loss).backward()
            # rho = exp(old - sampler logp): the trainer at the weights that sampled vs the sampler
            log.add(totals, loss, stats, entropy, mask[idx], old - sampler_logps[idx], aux, S)
        if S == 0:  # AdamW steps as after backward on rows with A = 0: on (scaled) zero gradients
            zero_gradient_without_rows(trainer)
        # 13. unscale (fp16), clip, AdamW, skipped on every rank if a rank's loss or norm is inf/NaN
        trainer.scaler.unscale_(trainer.optimizer)  # the true gradients: the clip sees real values
        grad_norm = clip_grad_norm(policy, args.grad_clip)  # FSDP: over every rank's shard
        if update_is_finite(trainer.scaler, state, totals["loss"], grad_norm, device, in_a_row):
            trainer.scaler.step(trainer.optimizer)  # optimizer.step(), the gradients unscaled
            trainer.scaler.update()
            applied = True
        trainer.optimizer.zero_grad(set_to_none=True)
    if applied:  # 13. the schedule moves once per step that applied an update (not a skipped one)
        trainer.scheduler.step()
    # 11, after the update: next alpha from one world entropy (sum, count) of the sampling policy
    sampled = log.updates[0]
    state.world_entropy = world_mean(sampled["entropy_sum"], sampled["tokens"], device=device)
    if args.use_adaptive_entropy:
        state.c, state.alpha = update_entropy_coef(
            state.c, state.world_entropy, target=args.entropy_target, delta=args.entropy_coef_delta,
            coef_min=args.entropy_coef_min, coef_max=args.entropy_coef_max)
    # 14. log: world values (sums and counts over the ranks, or the world's min and max)
    record = step_metrics(trainer, state, rewards, advantages, mask, no_eos, totals, sampled,
                          n_cut, G, N)
    record.update(entropy_coef_applied=alpha, grad_norm=grad_norm.item(), lr=lr, **log.times(N))
    if trainer.scaler.is_enabled():
        record["loss_scale"] = trainer.scaler.get_scale()
    return record

# --- Stages 1-2. Prompts and rollout: the *unwrapped* policy, eval mode, no graph -----------------
def tokenize_prompts(tokenizer, prompts, max_prompt_len, device, repeat=1):
    """Left-pad and left-truncate (keep the end, where the question and the generation prompt are).
    A prompt starts with the BOS its tokenizer puts first (Llama, Gemma, Mistral: as pretrained),
    never twice (a chat template that writes it, Llama-3's <|begin_of_text|>, gets none added), and
    keeps it when cut; no EOS is added. Each prompt is tokenized once, its row repeated `repeat`
    times (a group, contiguous). Returns input_ids [B * repeat, P], attention_mask [B * repeat, P]
    and how many of the B prompts were cut."""
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("a").input_ids[:1] == [bos]
    ids = tokenizer(list(prompts), add_special_tokens=False).input_ids
    ids = [[bos] + x if adds_bos and x[:1] != [bos] else x for x in ids]
    n_cut = sum(len(x) > max_prompt_len for x in ids)
    # a cut prompt keeps its BOS (the model never saw text without one) and loses content instead
    keep_bos = lambda x: x[:1] == [bos] and max_prompt_len > 1
    cut = lambda x: (x[:1] + x[len(x) - max_prompt_len + 1:] if keep_bos(x)
                     else x[len(x) - max_prompt_len:])
    ids = [cut(x) if len(x) > max_prompt_len else x for x in ids]
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=device)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
    return input_ids.repeat_interleave(repeat, 0), mask.repeat_interleave(repeat, 0), n_cut

@torch.no_grad()
def rollout(policy, input_ids, attention_mask, tokenizer, *, max_gen_len, do_sample=True,
            temperature=1.0, top_p=1.0, top_k=0, static_cache=False):
    """Sample with model.generate: completion ids [rows, T], mask [rows, T], no_eos [rows] and the
    sampler's log-prob of each token [rows, T] (0 outside the mask; None if greedy). It samples from
    top_k_top_p_filter(z / temperature, top_k, top_p) (SamplerLogps) alone: plain_generate sets
    aside a checkpoint's generation_config.json (repetition_penalty, ...: unscored)."""
    eos = eos_token_ids(policy, tokenizer)  # stop on, and mask after, every EOS declared
    sampler = SamplerLogps(temperature, top_k, top_p) if do_sample else None
    completion_ids = plain_generate(policy, input_ids, attention_mask, tokenizer, max_gen_len, eos,
                                    sampler, static_cache)                        # [rows, T]
    mask, no_eos = completion_mask(completion_ids, eos)
    # after EOS generate writes pads, which the truncation may have dropped (-inf)
    sampler_logps = (None if sampler is None
                     else torch.where(mask.bool(), sampler.finish(completion_ids), 0.0))
    return completion_ids, mask, no_eos, sampler_logps

class SamplerLogps:
    """A logits processor for generate: it applies the sampling distribution itself (temperature,
    top-k, top-p; generate's own are off) and keeps each sampled token's log-prob under it, gathered
    from step t's log-softmax when step t+1's input ends with it; finish() does the last token."""
    def __init__(self, temperature=1.0, top_k=0, top_p=1.0):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.previous, self.logps = None, []

    def __call__(self, input_ids, scores):                                       # scores [rows, V]
        if self.previous is not None:
            self.logps.append(self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        scores = top_k_top_p_filter(scores.float() / self.temperature, self.top_k, self.top_p)
        self.previous = torch.log_softmax(scores, dim=-1)
        return scores

    def finish(self, completion_ids):                                             # -> [rows, T]
        last = self.previous.gather(-1, completion_ids[:, -1:]).squeeze(-1)
        return torch.stack(self.logps + [last], dim=1)

def completion_mask(completion_ids, eos_token_id):
    # m_{i,t} = 1 for t <= first EOS (the EOS itself included: stopping is reinforced), 0 after;
    # eos_token_id: one id or a list (any of them ends the completion)
    eos = torch.as_tensor(eos_token_id, device=completion_ids.device)
    is_eos = torch.isin(completion_ids, eos)                                      # [rows, T]
    T = completion_ids.shape[1]
    never = torch.full_like(is_eos[:, 0], T, dtype=torch.long)
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), never)
    positions = torch.arange(T, device=completion_ids.device).expand_as(completion_ids)
    return (positions <= first_eos.unsqueeze(1)).long(), ~is_eos.any(1)  # mask, no_eos [rows]

# --- Stages 3-4. Rewards and advantages -----------------------------------------------------------
def compute_rewards(reward_fns, weights, completions, rows, completion_ids=None):
    # r_i = sum_k w_k * reward_k(o_i) over the rewards that apply (None: does not apply; TRL: NaN,
    # then nansum); reward_values: f(completion, **row) per sample, or TRL's batched form. A sample
    # no reward applies to, a reward that raises, or a value neither None nor finite stops the run
    rewards, applies = torch.zeros(len(completions)), [False] * len(completions)
    for fn, w in zip(reward_fns, weights):
        for i, value in enumerate(reward_values(fn, completions, completion_ids, rows)):
            if value is None:
                continue
            where = sample_name(i, completions[i], rows[i])
            if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
                raise TrainerError(f"reward {fn.__name__} returned {value!r:.40}, not a number, "
                                   f"{where}")
            if not math.isfinite(float(value)):
                raise TrainerError(f"reward {fn.__name__} returned {float(value)}, not a finite "
                                   f"number, {where}")
            rewards[i] += w * float(value)
            applies[i] = True
    if not all(applies):
        i = applies.index(False)
        raise TrainerError(f"every reward function returned None (does not apply) "
                           f"{sample_name(i, completions[i], rows[i])}")
    return rewards

def world_std(values, device="cpu"):
    # std (n - 1) of all ranks' values: sqrt((sum x^2 - (sum x)^2 / n) / (n - 1)), sums in fp64
    s, s2, n = world_sum(values.double().sum(), (values.double() ** 2).sum(), values.numel(),
                         device=device)
    return math.sqrt(max(s2 - s * s / n, 0.0) / max(n - 1, 1))

def compute_advantages(rewards, num_generations, scale_rewards="group", batch_std=None):
    # A_i = (r_i - mean_group(r)) / (std_group(r) + 1e-4), std with n - 1 (torch.std, as TRL).
    # "batch" divides by batch_std (the trainer passes all ranks' std), else by this batch's std
    grouped = rewards.view(-1, num_generations)                                   # [B, G]
    # a group whose rewards all tie gets exactly 0 (the float mean of G copies of 0.2 is not 0.2)
    tied = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    centered = torch.where(tied, 0.0, grouped - grouped.mean(dim=1, keepdim=True))
    if scale_rewards == "group":
        centered = centered / (grouped.std(dim=1, keepdim=True) + 1e-4)
    elif scale_rewards == "batch":
        centered = centered / ((rewards.std() if batch_std is None else batch_std) + 1e-4)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be group, batch or none, not {scale_rewards!r}")
    return centered.reshape(-1)                                                   # [B*G]

# --- Stages 5-7, 10. The rows trained; reference, old and current log-probs; entropy --------------
def scored_distribution(args):
    """The distribution scored (the ratio, the KL): the sampler's temperature and truncation."""
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)

def rows_to_train(args, trainer, advantages, mask, alpha):
    """The rows whose forward and backward can change the update: indices [kept]. A row with A = 0,
    or no masked token, adds exactly 0 to the gradient under a normalization whose divisor does not
    depend on the rows kept (README: Work without a gradient), so --skip_zero_advantage_rows 1 skips
    it, unless it counts elsewhere: the KL (beta > 0), an entropy bonus (alpha, this step's; an
    adaptive coefficient needs every row's entropy), the MoE router loss, or bnpo (skipping would
    change its divisor, each micro-batch's own tokens)."""
    exact = (args.beta == 0 and alpha == 0 and not args.use_adaptive_entropy
             and not is_moe(trainer.model) and args.loss_type != "bnpo")
    if not (args.skip_zero_advantage_rows and exact):
        return torch.arange(len(advantages), device=advantages.device)
    # a NaN advantage is kept: the step sees it
    return ((advantages != 0) & (mask.sum(1) > 0)).nonzero().squeeze(1)

def completion_logps(model, input_ids, attention_mask, num_completion_tokens, *, temperature=1.0,
                     top_k=0, top_p=1.0, chunk_size=0, entropy_grad=False, with_entropy=True):
    """Log-probs (and entropy) of each row's last T tokens: the model's forward, then its decoder's
    last hidden states through lm_logits, chunk_size tokens at a time (0: auto_chunk_tokens(V)), so
    [rows, T, V] logits never exist. temperature, top_k, top_p: the distribution scored (0 and 1:
    the full one). Call it with the DDP wrapper: its forward makes DDP all-reduce the gradients. No
    pass asks for every layer's hidden states (without grad only the last is kept). Returns logps
    [rows, T], entropy [rows, T] (a graph only if entropy_grad), and the router's aux loss (MoE,
    with grad) or None."""
    T = num_completion_tokens
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)   # as generate() computes them
    grad = torch.is_grad_enabled()
    moe = grad and is_moe(model)  # the router's load-balancing loss: for the loss alone
    # without grad (reference, old) past DDP's wrapper, whose forward syncs buffers (a collective);
    # FSDP's is the model itself: its root's forward gathers the embeddings and lm_head
    net = model if grad else unwrap(model)
    hidden, out = forward_last_hidden(net, input_ids=input_ids, attention_mask=attention_mask,
                                      position_ids=position_ids, use_cache=False,
                                      **({"output_router_logits": True} if moe else {}))
    aux = getattr(out, "aux_loss", None) if moe else None
    hidden = hidden[:, -T - 1:-1, :]                                  # [rows, T, H]: before token t
    targets = input_ids[:, -T:]                                                   # [rows, T]
    head = functools.partial(lm_logits, unwrap(model))      # lm_head + the model's post-processing
    # truncating holds more [c, V] tensors (the sort's values and indices, a mask): smaller chunks
    truncating = top_k > 0 or top_p < 1.0
    vocab = unwrap(model).get_output_embeddings().weight.shape[0]
    chunk_size = chunk_size or auto_chunk_tokens(vocab) // (4 if truncating else 1) or 1
    rows, logps, entropy = targets.shape[0], [], []
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    for h, y in zip(hidden.reshape(rows * T, hidden.shape[-1]).split(chunk_size),    # [c, H]
                    targets.reshape(rows * T).split(chunk_size)):                      # [c]
        if grad:  # keep the chunk's inputs; recompute its logits in backward
            lp, ent = checkpoint(_chunk_logps_entropy, head, h, y, sampling, entropy_grad,
                                 with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_logps_entropy(head, h, y, sampling, False, with_entropy)
        logps.append(lp)
        entropy.append(ent)
    return torch.cat(logps).view(rows, T), torch.cat(entropy).view(rows, T), aux

def _chunk_logps_entropy(lm_head, hidden, targets, sampling, entropy_grad, with_entropy=True):
    """One chunk of completion_logps: hidden [c, H] -> logits [c, V], which exist only here.
    lm_head: anything mapping hidden states to logits (lm_logits); sampling: temperature, top_k,
    top_p of the distribution scored."""
    logits = lm_head(hidden).float()           # [c, V]: the one fp32 copy (bf16 under autocast)
    if sampling["temperature"] != 1.0:
        logits.div_(sampling["temperature"])   # in place: no second [c, V] (nothing saved it)
    # sampling replay: score under the truncation the sampler used, renormalized over the kept set
    # (the sampled token always kept): logp = z[o] - logsumexp(z[kept])
    scored = top_k_top_p_filter(logits, sampling["top_k"], sampling["top_p"], keep=targets)
    logps = selective_log_softmax(scored, targets)
    if not with_entropy:
        return logps, torch.zeros_like(logps.detach())
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        # only logged: no graph at all (detached, no_grad); a bonus: in the graph, recomputed in
        # backward. The entropy is the full (tempered) distribution's, truncated or not
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    return logps, entropy

def lm_logits(model, hidden):
    # z = lm_head(h), then what the model's own forward applies after it: Cohere z * logit_scale,
    # Granite z / logits_scaling, Gemma-2/3 cap * tanh(z / cap); check_output_head() refuses others
    config = model.config.get_text_config()
    z = model.get_output_embeddings()(hidden)
    if getattr(config, "logit_scale", None) is not None:
        z = z * config.logit_scale
    if getattr(config, "logits_scaling", None) is not None:
        z = z / config.logits_scaling
    if getattr(config, "final_logit_softcapping", None):
        z = torch.tanh(z / config.final_logit_softcapping) * config.final_logit_softcapping
    return z

def top_k_top_p_filter(z, top_k=0, top_p=1.0, keep=None):
    """Top-k, then top-p, as generate applies them (its order, its ties): dropped tokens get -inf,
    so a softmax renormalizes over the kept set. keep [N]: a token id per row that stays whatever
    (the sampled one). z: [N, V] logits already divided by the temperature."""
    if top_k <= 0 and top_p >= 1.0:
        return z
    drop = torch.zeros_like(z, dtype=torch.bool)                                  # [N, V]
    if top_k > 0:  # keep the k largest (and any tied with the k-th)
        drop |= z < torch.topk(z, min(top_k, z.shape[-1]), dim=-1).values[:, -1:]
    # drop the least likely tokens while their total mass is <= 1 - top_p; the likeliest stays
    if top_p < 1.0:
        sorted_z, order = torch.sort(z.masked_fill(drop, float("-inf")), dim=-1)  # ascending
        sorted_drop = sorted_z.softmax(-1).cumsum(-1) <= 1 - top_p
        sorted_drop[:, -1] = False
        drop |= sorted_drop.scatter(-1, order, sorted_drop)
    if keep is not None:
        drop.scatter_(-1, keep.reshape(-1, 1), False)
    return z.masked_fill(drop, float("-inf"))

def selective_log_softmax(logits, index):
    # log p(index) = z[index] - logsumexp(z) over the last dim, without a [.., V] log-softmax: its
    # temporaries are the size of z, which the caller's chunk bounds (LOGITS_BUDGET_MIB, N tokens)
    z = logits.reshape(-1, logits.shape[-1]).float()                                # [N, V]
    logps = z.gather(-1, index.reshape(-1, 1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return logps.view(index.shape)

def entropy_from_logits(logits):
    # H = logsumexp(z) - sum_v softmax(z)_v * z_v, per row of [.., V]: a few temporaries the size
    # of z, which the caller's chunk bounds
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)   # without V

# --- Stages 8-9. The objective and its normalization ---------------------------------------------
def loss_divisor(loss_type, rows, S, N, world, max_gen_len):
    """Stage 9: the step's divisor D of each micro-batch's loss: sum L m / D (grpo: the sum of its
    row means / D; bnpo: its token mean / D). rows: this rank's B*G rows in the step; S: the step's
    micro-batches; N: masked tokens, all ranks (README table)."""
    if loss_type == "grpo":     # D = rows          (each row first averaged over its tokens)
        return rows
    if loss_type == "bnpo":     # D = S             (each micro-batch averaged over its tokens)
        return S
    if loss_type == "dr_grpo":  # D = rows * L_max
        return rows * max_gen_len
    if loss_type in ("dapo", "cispo"):  # D = max(N / world, 1)
        return max(float(N) / world, 1.0)
    raise ValueError(f"unknown loss_type {loss_type!r}; choose from {LOSS_TYPES}")

def grpo_loss(logps, old_logps, advantages, mask, *, loss_type, epsilon, epsilon_high, divisor,
              ref_logps=None, beta=0.0, entropy=None, alpha=0.0,
              importance_sampling_level="token"):
    """logps/old_logps/ref_logps/mask/entropy: [rows, T]; advantages: [rows]; divisor: the step's D
    (loss_divisor). Returns (loss, stats). old_logps and ref_logps must carry no graph: pass
    logps.detach() when on-policy. importance_sampling_level "sequence"
    (GSPO): one ratio s_i per sequence, clipped and applied to each of its tokens (meant for grpo,
    refused for cispo); clip_ratio counts masked tokens either way: a clipped sequence counts all
    its tokens."""
    assert not old_logps.requires_grad, "old_logps must be detached: exp(x - x) has zero gradient"
    mask = mask.to(logps.dtype)
    A = advantages.to(logps.dtype).unsqueeze(1)                                   # [rows, 1]
    # r = exp(logp - old): value 1 on-policy, gradient r * dlogp (old carries no graph)
    log_ratio = logps - old_logps                                                 # [rows, T]
    if importance_sampling_level == "sequence":
        assert loss_type != "cispo", "GSPO's sequence ratio is for the clipped objective"
        # GSPO: log s_i = sum_t m (logp - old) / max(sum_t m, 1), the same s_i on each token of o_i
        log_ratio = ((log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(
            min=1)).expand_as(logps)
    ratio = torch.exp(log_ratio)
    if loss_type == "cispo":
        # L = -sg(min(r, eps_h)) * A * logp: a capped, gradient-free weight on a REINFORCE term
        pg = -torch.clamp(ratio, max=epsilon_high).detach() * A * logps
        clipped = (ratio > epsilon_high) & (A > 0)  # counted as TRL does: the upper side, A > 0
    else:
        # L = -min(r * A, clip(r, 1 - eps, 1 + eps_h) * A)
        pg = -torch.min(ratio * A, torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * A)
        clipped = ((ratio < 1 - epsilon) & (A < 0)) | ((ratio > 1 + epsilon_high) & (A > 0))
    per_token = pg  # the policy-gradient term; the KL and entropy terms join it below
    stats = {}
    if beta > 0:
        # k3: KL = exp(ref - logp) - (ref - logp) - 1, added as + beta * KL
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
        stats["kl_sum"] = (kl * mask).sum().detach()                              # logged: a sum
    if entropy is not None and alpha != 0.0:
        per_token = per_token - alpha * entropy                                   # - alpha * H

    def normalized(x):  # 9. sum L m / D; grpo first averages each row, bnpo the micro-batch
        total = x * mask
        if loss_type == "grpo":  # sum_i [sum_t L m / max(sum_t m, 1)] / D
            return (total.sum(1) / mask.sum(1).clamp(min=1)).sum() / divisor
        if loss_type == "bnpo":  # sum L m / max(sum m, 1) / D
            return total.sum() / mask.sum().clamp(min=1) / divisor
        return total.sum() / divisor  # dr_grpo, dapo, cispo
    loss = normalized(per_token)
    stats["policy_loss"] = normalized(pg.detach())
    stats["clip_ratio"] = (clipped.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)
    return loss, stats

# --- Stage 13. The learning-rate schedule --------------------------------------------------------
def lr_factor(updated, args):
    # the next update's rate is lr * f, `updated`: steps so far that applied an update (the
    # scheduler's count: a step whose updates were all skipped does not move it), from 0:
    # f = (updated + 1) / (warmup + 1) in warmup, then 1 (constant)
    # or 0.5 (1 + cos(pi * (updated - warmup) / (max_steps - warmup))) (cosine)
    if updated < args.warmup_steps:
        return (updated + 1) / (args.warmup_steps + 1)
    if args.lr_scheduler == "constant":
        return 1.0
    progress = (updated - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

# --- Stage 11. The next step's entropy coefficient: one world number on every rank ----------------
def world_mean(local_sum, local_count, device="cpu"):
    # H_w = all_reduce(sum H*m) / all_reduce(sum m): a sum and a count, never a mean of rank means
    total, count = world_sum(local_sum, local_count, device=device)
    return total / count if count else float("nan")  # nan: nothing was measured

def update_entropy_coef(c, world_entropy, *, target, delta, coef_min, coef_max):
    # c <- min(c + delta, c_max) if H_w < target else max(c - delta, c_min)
    # the next step applies alpha = c if H_w < target else 0
    if world_entropy < target:
        c = min(c + delta, coef_max)
        return c, c
    return max(c - delta, coef_min), 0.0

# ==================================================================================================
# PLUMBING: what runs the step (the loop, flags, tasks and their rewards, models with dropout off,
# processes, the clip and loss-scale mechanics, checkpoints, reporting); the step's math is above.
# ==================================================================================================

# --- The loop: set up, then one grpo_step per step ------------------------------------------------
def train(args, rank, world, device):
    """Set up, start or resume, then the loop: prompts, one GRPO step, evaluate, log, save."""
    started = time.time()
    # model (DDP/FSDP-wrapped as `model`), data, the built-in task's supervised warm-up
    policy, model, tokenizer, task, prompt_order = set_up(args, rank, world, device)
    train_rows, eval_rows, reward_fns, weights, (eval_key, score) = task
    # frozen reference copy of the starting policy, only when the KL term exists
    ref_model = frozen_copy(policy, getattr(torch, args.dtype)) if args.beta > 0 else None
    optimizer, scheduler = build_optimizer(policy, args)
    trainer = Trainer(model, ref_model, optimizer, scheduler, loss_scaler(args.dtype, device),
                      tokenizer, reward_fns, weights, world, device)

    # --- fresh start (with the eval before any update), or resume from a checkpoint ---
    state, metrics_path, (report, close_report) = start_or_resume(
        args, trainer, scheduler, eval_rows, score, eval_key, rank)

    # a run resumed at max_steps trains nothing: final/ is the checkpoint it resumed from
    done = find_checkpoint(args.save_dir) if args.resume == "auto" else args.resume
    source = done if state.step == args.max_steps else None
    # --- the loop: prompts, one GRPO step, evaluate, log, save ---
    model.train()
    bar = tqdm(range(state.step + 1, args.max_steps + 1), initial=state.step, total=args.max_steps,
               disable=rank != 0, desc="grpo")
    for step in bar:
        state.step = step
        rows = next_prompts(prompt_order, train_rows, state, args.batch_size)
        cut_before = state.truncated_prompts
        record = {"step": step, **grpo_step(args, trainer, rows, state)}
        stop_if_failing(args, state, step)
        if args.eval_interval > 0 and (step % args.eval_interval == 0 or step == args.max_steps):
            record[eval_key] = evaluate(policy, tokenizer, eval_rows, score, args, rank, world,
                                        device)
        log_metrics(metrics_path, record, rank, report)
        show_progress(bar, record, args, state, cut_before, eval_key, world)
        stopping = args.stop_after and step >= args.stop_after
        periodic = args.save_interval and step % args.save_interval == 0
        if periodic or step == args.max_steps or stopping:
            save(args, trainer, scheduler, state, rank)
        if stopping:
            break

    finish(args, policy, tokenizer, state, metrics_path, eval_key, started, rank, source)
    if close_report is not None:
        close_report()
    barrier()
    return {"model": policy, "step": state.step, "c": state.c, "alpha": state.alpha,
            "world_entropy": state.world_entropy}

def frozen_copy(policy, dtype):
    """The reference: a frozen, unsharded copy of the policy as it is now, computing exactly what
    the policy computes at equal weights. Under autocast the policy's Linear layers read a --dtype
    copy of their fp32 weights: the reference stores just that copy and keeps the rest as the policy
    has it (embeddings and a head tied to them, norms, MoE expert tensors, RoPE's inv_freq: fp32);
    `.to(bf16)` on the whole copy would round those too: KL != 0 at step 1. Under FSDP every
    parameter arrives in --dtype (its MixedPrecisionPolicy; buffers fp32), so the reference's do."""
    import copy
    if not is_fsdp(policy):
        ref = copy.deepcopy(policy).eval().requires_grad_(False)
        embedding = ref.get_input_embeddings().weight
        for module in ref.modules():
            # a tied head stays fp32, and an fp32 head (--cast_lm_head_to_fp32) too
            if (isinstance(module, torch.nn.Linear) and module.weight is not embedding
                    and not isinstance(module, Fp32Linear)):
                module.to(dtype)
        return ref
    from transformers import AutoModelForCausalLM
    full = full_state_dict(policy, every_rank=True)
    ref = AutoModelForCausalLM.from_config(policy.config).to(next(iter(full.values())).device)
    disable_dropout(ref)
    ref.load_state_dict(full)
    for p in ref.parameters():
        p.data = p.data.to(dtype)
    return ref.eval().requires_grad_(False)

# --- The step's bookkeeping: its timing and sums (for the log), gradients without rows -----------
class StepLog:
    """Stage 14's bookkeeping for one step: its clock (started here with the peak memory reset;
    `with log:` times the rollout) and each update's sums over its micro-batches (updates[0]: the
    policy that sampled), Python floats added in micro-batch order."""
    def __init__(self, device):
        self.device, self.start, self.generate_time, self.updates = device, time.time(), 0.0, []
        reset_peak_memory(device)

    def __enter__(self):
        self.generate_start = time.time()

    def __exit__(self, *exc):
        self.generate_time = time.time() - self.generate_start

    def new_update(self, rows):
        first = not self.updates  # the sampler mismatch is read from the first update alone
        self.updates.append({"loss": 0.0, "policy_loss": 0.0, "kl_sum": 0.0, "clip": 0.0,
                             "aux": 0.0, "entropy_sum": 0.0, "tokens": 0.0, "rows": rows,
                             "gap": [] if first else None, "gap_mask": []})  # old - sampler logp
        return self.updates[-1]

    @staticmethod
    def add(totals, loss, stats, entropy, m, gap, aux, S):
        tokens = m.sum().item()
        for k, v in (("loss", loss.detach()), ("policy_loss", stats["policy_loss"]),
                     ("tokens", tokens), ("kl_sum", stats.get("kl_sum", 0.0)),
                     ("clip", stats["clip_ratio"] * tokens),
                     ("entropy_sum", (entropy.detach() * m).sum())):
            totals[k] += float(v)
        if aux is not None:
            totals["aux"] += aux.item() / S
        if totals["gap"] is not None:  # [trained, T], kept for the first update only
            totals["gap"].append(torch.where(m.bool(), gap, 0.0))
            totals["gap_mask"].append(m)

    def times(self, num_items):
        dt = time.time() - self.start
        return dict(step_time=dt, generate_time=self.generate_time,
                    generate_share=self.generate_time / dt, tokens_per_s=num_items / dt,
                    peak_mem_gib=peak_memory_gib(self.device))

def zero_gradient_without_rows(trainer, stand_in_logps=None):
    """A gradient of exactly 0 where there is no row to train: a rank out of rows backpropagates
    0 x its stand-in row's log-probs (DDP's all-reduce, FSDP's reduce-scatter still run); in a step
    where no rank keeps a row, every gradient is set to a (scaled) zero: AdamW steps as after rows
    with A = 0 (a zero gradient, not none)."""
    if stand_in_logps is not None:
        trainer.scaler.scale(0.0 * stand_in_logps.sum()).backward()
        return
    for p in unwrap(trainer.model).parameters():  # fp16: scale() creates the scale unscale_ reads
        p.grad = trainer.scaler.scale(torch.zeros_like(p)) if p.requires_grad else None

# --- Flags: checked before any work; a problem is one line `error: ...` ---------------------------
class TrainerError(Exception):
    """A problem with the user's input: reported as one line `error: ...`, never a traceback."""

def one_line(e):
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"

def build_parser():
    """One flag per Args field, in the groups Args' comments name; --help shows each default. A flag
    not typed is absent from the parse: Args' defaults, or a task's own, fill it in."""
    tasks = "; ".join(f"--dataset {k}: " + ", ".join(f"--{n} {v}" for n, v in d.items())
                      for k, d in TASK_DEFAULTS.items())
    parser = argparse.ArgumentParser(
        description="GRPO trainer: one file, every formula tested (README.md)",
        epilog=f"a task's own defaults (a flag given wins): {tasks}")
    parser.error = lambda message: parser.exit(2, f"error: {message}\n")  # one line, no usage
    fields, group = {f.name: f for f in dataclasses.fields(Args)}, parser
    for line in inspect.getsource(Args).splitlines():
        comment = re.fullmatch(r"    # (.+)", line)
        name = re.match(r"    (\w+): \w+ = flag\(", line)
        if comment:
            group = parser.add_argument_group(comment.group(1))
        elif name:
            f = fields.pop(name.group(1))
            group.add_argument(f"--{f.name}", type=type(f.default), default=argparse.SUPPRESS,
                               choices=f.metadata.get("choices"),
                               help=f"{f.metadata['help']} (default: {f.default!r})")
    assert not fields, f"Args fields not declared as `name: type = flag(...)`: {sorted(fields)}"
    return parser

def parse_args(argv=None):
    parser = build_parser()
    given = vars(parser.parse_args(argv))  # only the flags typed: they win over a task's sizes
    args = Args(**{**TASK_DEFAULTS.get(given.get("dataset", Args.dataset), {}), **given})
    for problem in check_args(args):
        parser.error(problem)
    return args

def check_args(a):
    """Every flag against what it means, before any work: one message per problem, naming it."""
    positive = ("batch_size max_steps max_gen_len max_prompt_len num_iterations learning_rate "
                "sft_learning_rate micro_batch_tokens temperature").split()
    non_negative = ("micro_batch_size logp_chunk_size top_k beta weight_decay warmup_steps "
                    "grad_clip sft_warmup_steps save_interval eval_interval eval_size stop_after "
                    "entropy_coef_delta entropy_coef_min entropy_target epsilon_high").split()
    rows = a.batch_size * a.num_generations
    rules = [  # (the condition that must hold, the message when it does not)
        (a.num_generations >= 2, "--num_generations must be >= 2 (a group of 1 has no baseline)"),
        *[(getattr(a, n) > 0, f"--{n} must be > 0, got {getattr(a, n)}") for n in positive],
        *[(getattr(a, n) >= 0, f"--{n} must be >= 0, got {getattr(a, n)}") for n in non_negative],
        (not a.micro_batch_size or rows % a.micro_batch_size == 0, f"--micro_batch_size "
         f"{a.micro_batch_size} must divide batch_size * num_generations = {rows}"),
        (a.eval_size > 0 or a.eval_interval == 0,
         f"--eval_interval {a.eval_interval} evaluates held-out prompts, but --eval_size 0 holds "
         "none out (set --eval_interval 0, or --eval_size > 0)"),
        (0 <= a.epsilon < 1, f"--epsilon must be in [0, 1), got {a.epsilon}"),
        (0 < a.top_p <= 1, f"--top_p must be in (0, 1], got {a.top_p}"),
        (a.importance_sampling_level == "token" or a.loss_type != "cispo",
         "--importance_sampling_level sequence (GSPO) is for --loss_type grpo, not cispo (as TRL)"),
        (not (a.cast_lm_head_to_fp32 and a.fsdp), "--cast_lm_head_to_fp32 1 with --fsdp 1: FSDP "
         "gathers the lm_head in --dtype, so it would not be an fp32 head; use DDP (--fsdp 0)"),
        (a.entropy_coef_min <= a.entropy_coef_max, f"--entropy_coef_min {a.entropy_coef_min} "
         f"must be <= --entropy_coef_max {a.entropy_coef_max}"),
        *[(math.isfinite(getattr(a, f.name)), f"--{f.name} must be a finite number, got "
           f"{getattr(a, f.name)}") for f in dataclasses.fields(a) if f.type is float],
        (a.device != "cuda" or torch.cuda.is_available(), "--device cuda: no CUDA GPU is visible"),
        (a.dataset or not a.model_name_or_path,
         "--model_name_or_path needs --dataset (the built-in task uses its own tiny tokenizer)"),
        (a.model_name_or_path or not a.dataset, f"--dataset {a.dataset} needs --model_name_or_path "
         "(the built-in tiny model knows only the reversal task's characters)"),
        (not os.path.isfile(a.save_dir), f"--save_dir {a.save_dir} is a file, not a directory"),
        (a.resume in ("", "auto") or os.path.isdir(a.resume),
         f"--resume {a.resume}: no such checkpoint directory"),
    ]
    yield from (message for ok, message in rules if not ok)
    if a.reward_weights:
        try:
            weights = [float(w) for w in a.reward_weights.split(",")]
        except ValueError:
            yield f"--reward_weights {a.reward_weights!r}: expected comma-separated numbers (1,0.1)"
            return
        names = (a.reward_funcs.split(",") if a.reward_funcs else
                 [f.__name__ for f in task_rewards(a)[0]])
        if len(weights) != len(names) or not all(map(math.isfinite, weights)):
            yield (f"--reward_weights has {len(weights)} value(s) for {len(names)} reward "
                   f"function(s) ({', '.join(names)}), each finite")
    for item in filter(None, a.reward_funcs.split(",")):
        path = item.strip().rpartition(":")[0]
        if path and not os.path.isfile(path):
            yield f"--reward_funcs {item}: no such file {path}"
    if a.report_to != "none" and importlib.util.find_spec(a.report_to) is None:
        yield f"--report_to {a.report_to}: the package is not installed (pip install {a.report_to})"
    yield from check_paths(a)

def check_paths(a):
    name, path = a.model_name_or_path, os.path.expanduser(a.model_name_or_path)
    flag, data = f"--model_name_or_path {name}", os.path.expanduser(a.dataset)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            yield f"{flag}: no such file"
        for package in ("gguf", "accelerate"):  # transformers reads GGUF through both
            if importlib.util.find_spec(package) is None:
                yield (f"{flag}: reading a GGUF file needs the {package} package (pip install "
                       "gguf accelerate)")
    elif name and (name.startswith((".", "/", "~")) or os.path.exists(path)):
        weights = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
        if not os.path.isdir(path):
            yield f"{flag}: no such directory"
        elif not os.path.isfile(os.path.join(path, "config.json")):
            yield f"{flag}: no config.json in this directory"
        elif not [f for f in os.listdir(path) if f.endswith(weights)]:
            yield f"{flag}: no model weights (*.safetensors, *.bin) here"
    if os.path.isdir(data):
        yield f"--dataset {a.dataset} is a directory: give a .jsonl/.json/.parquet file or hub name"
    elif a.dataset.endswith((".jsonl", ".json", ".parquet")) and not os.path.isfile(data):
        yield f"--dataset {a.dataset}: no such file"

# --- Tasks and datasets ---------------------------------------------------------------------------
# The built-in task: reverse a string of letters, "cabde=" -> "edbac". Its reward is checked by code
# (the share of characters in the right place), it has a held-out split of strings never trained on,
# and a 2-layer model can solve it, so a few minutes on a CPU show whether the algorithm learns.
REVERSE_ALPHABET = "abcdefgh"
REVERSE_LEN = 5

def make_reverse_task(eval_size, seed=1234):
    rng = random.Random(seed)
    strings = set()
    while len(strings) < 6000:
        strings.add("".join(rng.choice(REVERSE_ALPHABET) for _ in range(REVERSE_LEN)))
    rows = [{"prompt": s + "=", "answer": s[::-1]} for s in sorted(strings)]
    rng.shuffle(rows)
    return rows[eval_size:], rows[:eval_size]

def reverse_reward(completion, answer):
    # characters in the right place / the longer length: 1.0 only for an exact match
    return sum(a == b for a, b in zip(completion, answer)) / max(len(completion), len(answer), 1)

# GSM8K: the reference is the number after "####". The model is asked to end with the same form.
GSM8K_SYSTEM_PROMPT = ("Solve the math problem. Reason step by step, then write the final answer "
                       "alone on the last line as '#### <number>'.")

# digits in groups of three may be separated by ',', LaTeX's '{,}' or a space ('1{,}000', '1 000')
_NUMBER = r"-?[$]?\s*-?(?:\d{1,3}(?:(?:\{,\}| )\d{3})+(?!\d)|\d[\d,]*)(?:\.\d+)?"

def parse_number(text):
    """'$1,234.50' -> Fraction(2469, 2); None if it is not a number. Exact: no float, no eval."""
    t = re.sub(r"\{,\}|[,$ ]", "", (text or "").strip()).rstrip(".")  # no separators, no '$'
    digits = t.lstrip("-")
    if not re.fullmatch(r"\d+(?:\.\d+)?", digits):
        return None
    return -Fraction(digits) if t.startswith("-") else Fraction(digits)

def gsm8k_reference(answer):
    """GSM8K's worked answer ends with '#### N'; a bare number is accepted too."""
    return parse_number(str(answer).split("####")[-1])

def gsm8k_correct_reward(completion, answer):
    # 1.0 if the completion's final answer equals the reference number, else 0.0. Its final answer:
    # the last tagged '#### N' (or \boxed{N}, 'answer is N'), else its last number
    for pattern in (r"####\s*(" + _NUMBER + ")", r"\\boxed\{\s*(" + _NUMBER + r")\s*\}",
                    r"answer is[:\s]*(" + _NUMBER + ")", _NUMBER):
        found = re.findall(pattern, completion, flags=re.IGNORECASE)
        if found:
            predicted = parse_number(found[-1])
            return float(predicted is not None and predicted == gsm8k_reference(answer))
    return 0.0

def gsm8k_format_reward(completion, answer):
    # 1.0 if the completion ends with a line '#### <number>', else 0.0
    return float(re.search(r"####\s*" + _NUMBER + r"\s*$", completion.strip()) is not None)

# compare_numbers, the built-in task for a real instruct model: the larger of two 2-digit numbers,
# alone. SmolLM2-135M-Instruct (greedy) answers 1% of held-out questions as asked, the rest in prose
# or wrongly, yet one of 8 samples is right for ~65% of prompts: signal GRPO turns into the answer.
COMPARE_NUMBERS = "compare_numbers"

def make_compare_task(eval_size, seed=1234):
    """Held out: the first eval_size pairs of a seeded shuffle, in neither order trained on."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100) if a != b]
    random.Random(seed).shuffle(pairs)
    held_out = {frozenset(p) for p in pairs[:eval_size]}
    trained = [p for p in pairs[eval_size:] if frozenset(p) not in held_out]
    question = "Which number is larger, {} or {}? Answer with the number only."
    rows = lambda pairs: [{"prompt": [{"role": "user", "content": question.format(a, b)}],
                           "answer": max(a, b)} for a, b in pairs]
    return rows(trained), rows(pairs[:eval_size])

def compare_correct_reward(completion, answer):
    # 1.0 if the first number in the completion is the larger one ("43 is larger than 15": 43)
    first = re.search(r"-?\d+", completion)
    return float(first is not None and int(first.group()) == int(answer))

def compare_format_reward(completion):
    # 1.0 if the completion is a number alone ("43" or "43."), as the prompt asks, else 0.0
    return float(re.fullmatch(r"\s*-?\d+\.?\s*", completion) is not None)

def task_rewards(args):
    """The task's reward functions, its correctness first, and their default weights."""
    if not args.dataset:
        return [reverse_reward], [1.0]
    if args.dataset == COMPARE_NUMBERS:
        return [compare_correct_reward, compare_format_reward], [1.0, 0.5]
    return [gsm8k_correct_reward, gsm8k_format_reward], [1.0, 0.1]

def load_reward_funcs(spec):
    """'file.py:name,gsm8k_format_reward' -> functions. A file is imported as a module (its own
    code, never model text); a bare name is one of this file's reward functions."""
    fns = []
    for item in spec.split(","):
        path, _, name = item.strip().rpartition(":")
        if path:  # check_args has made sure the file exists
            try:
                spec_ = importlib.util.spec_from_file_location(f"reward_{len(fns)}", path)
                module = importlib.util.module_from_spec(spec_)
                spec_.loader.exec_module(module)
            except Exception as e:
                raise TrainerError(f"--reward_funcs {item}: importing {path} failed "
                                   f"({one_line(e)})") from None
            functions = vars(module)
        else:
            functions = {k: v for k, v in globals().items() if k.endswith("_reward")}
        fn = functions.get(name)
        if not callable(fn):
            where = path or "train_grpo.py's *_reward functions (file.py:name for your own)"
            raise TrainerError(f"--reward_funcs {item}: no function {name!r} in {where}")
        extras = set(inspect.signature(fn).parameters) & {"trainer_state", "log_metric",
                                                           "log_extra"}
        if extras:
            raise TrainerError(f"--reward_funcs {item}: {name} takes {', '.join(sorted(extras))}, "
                               "which TRL 1.x passes and this trainer does not")
        fns.append(fn)
    return fns

# a row's key for the prompt as the dataset gave it (chat messages stay messages): TRL's `prompts`
DATASET_PROMPT = "_dataset_prompt"

def load_rows(args):
    import datasets
    name, path = args.dataset, os.path.expanduser(args.dataset)
    if name == COMPARE_NUMBERS:
        return make_compare_task(args.eval_size)
    local = name.endswith((".jsonl", ".json", ".parquet")) or name.startswith((".", "/", "~"))
    if local and not os.path.isfile(path):
        raise TrainerError(f"--dataset {name}: no such file")
    if local and os.path.getsize(path) == 0:
        raise TrainerError(f"--dataset {name}: the dataset is empty")
    source, config = ("openai/gsm8k", "main") if name == "gsm8k" else (name, None)
    if local:  # a file, through the builder of its format
        source, config = ("parquet" if path.endswith(".parquet") else "json"), None
    try:
        splits = datasets.load_dataset(source, config, data_files=path if local else None)
    except Exception as e:  # a malformed file, a name the hub does not know: say which, in one line
        what = "could not be read" if local else f"could not load {source}"
        raise TrainerError(f"--dataset {name}: {what} ({one_line(e)})")
    train = splits["train"] if "train" in splits else splits[list(splits)[0]]
    columns = train.column_names
    uses_question = args.question_field in columns or "prompt" not in columns
    needed = [args.question_field, args.answer_field] if uses_question else ["prompt"]
    missing = [f for f in needed if f not in columns]
    if missing:
        raise TrainerError(f"--dataset {name}: missing field(s) {', '.join(missing)} (has "
                           f"{', '.join(columns)}); set --question_field/--answer_field, or give "
                           "a 'prompt' field")
    if len(train) == 0:
        raise TrainerError(f"--dataset {name}: the dataset is empty")
    rows = [dict(r) for r in train]
    if "train" in splits and "test" in splits:
        return rows, [dict(r) for r in splits["test"]][:args.eval_size]
    # one split only (a file, a test-only set): its first rows, at most a tenth, are held out
    n_eval = min(args.eval_size, len(rows) // 10)
    return rows[n_eval:], rows[:n_eval]

def render_prompt(tokenizer, row, args):
    """A row's prompt text: its question with GSM8K's system prompt (through the chat template if
    any), its 'prompt' as is (text) or through the chat template (messages)."""
    template = getattr(tokenizer, "chat_template", None)
    if args.question_field in row:
        question = row[args.question_field]
        if not template:
            return f"{GSM8K_SYSTEM_PROMPT}\n\nQuestion: {question}\nAnswer:"
        prompt = [{"role": "system", "content": GSM8K_SYSTEM_PROMPT},
                  {"role": "user", "content": question}]
    else:
        prompt = row["prompt"]
        if isinstance(prompt, str):
            return prompt
        if not template:
            raise TrainerError("--dataset: the prompts are chat messages, but the tokenizer has no "
                               "chat template")
    prefill = prompt[-1]["role"] == "assistant"  # "<think>": the completion goes on, as TRL
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=not prefill,
                                         continue_final_message=prefill)

def chat_prefill(row):
    """The assistant message a row's chat prompt ends with (TRL's "bootstrap"), else ''."""
    prompt = row.get(DATASET_PROMPT)
    ends = isinstance(prompt, list) and prompt[-1]["role"] == "assistant"
    return prompt[-1]["content"] if ends else ""

def given_prompt(tokenizer, row, args):
    """A row as the rewards see it: its columns as the dataset has them, 'prompt' rendered."""
    given = {**row, "prompt": render_prompt(tokenizer, row, args)}
    if args.question_field not in row:
        given[DATASET_PROMPT] = row["prompt"]
    return given

def answer_from(fn, field):
    """fn(completion, answer) reading its answer from the row's `field` column."""
    def reward(completion, **row):
        return fn(completion, answer=row[field])
    reward.__name__ = fn.__name__
    return reward

def load_task(args, tokenizer, world):
    """Train and eval rows, reward functions, weights, (name, score(texts, rows, ids) -> a list)."""
    if not args.dataset:
        train_rows, eval_rows = make_reverse_task(args.eval_size)
    else:
        train_rows, eval_rows = ([given_prompt(tokenizer, r, args) for r in rows]
                                 for rows in load_rows(args))
    reward_fns, weights = task_rewards(args)
    is_correct = reward_fns[0]
    answer_key = args.answer_field if args.dataset not in ("", COMPARE_NUMBERS) else "answer"
    if answer_key != "answer":  # the task's own rewards take `answer`: hand them this column
        reward_fns = [answer_from(fn, answer_key) for fn in reward_fns]
    if args.reward_funcs:  # your own: weight 1.0 each unless --reward_weights says otherwise
        reward_fns = load_reward_funcs(args.reward_funcs)
        weights = [1.0] * len(reward_fns)
    if args.reward_weights:
        weights = [float(w) for w in args.reward_weights.split(",")]
    if len(train_rows) < args.batch_size * world:
        raise TrainerError(f"the training set has {len(train_rows)} prompts, fewer than "
                           f"batch_size * ranks = {args.batch_size * world}")

    def score(texts, rows, ids):
        if args.reward_funcs:  # their weighted sum; a batched function sees groups of one
            return compute_rewards(reward_fns, weights, texts, rows, ids).tolist()
        return [float(is_correct(t, r[answer_key]) == 1.0) for t, r in zip(texts, rows)]
    key = "eval_reward" if args.reward_funcs else "eval_accuracy"
    return train_rows, eval_rows, reward_fns, weights, (key, score)

# --- Models: the built-in tiny one, pretrained ones, the warm start -------------------------------
def build_char_tokenizer(chars):
    """A character-level tokenizer made in-process: a token per character, <pad> <eos> <unk>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + list(chars))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # by character
    tok.decoder = decoders.Fuse()  # decode joins characters without spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left")

def build_tiny_model(vocab_size, use_moe, tokenizer):
    """A 75k-parameter Qwen3 (dense) or Qwen3-MoE causal LM from a config: no download."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    common = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                  tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    if use_moe:
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(
            intermediate_size=128, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, router_aux_loss_coef=0.01, **common))
    return Qwen3ForCausalLM(Qwen3Config(intermediate_size=128, **common))

def is_moe(model):
    return hasattr(unwrap(model).config, "router_aux_loss_coef")

def load_model_and_tokenizer(args, device):
    if not args.model_name_or_path:
        tokenizer = build_char_tokenizer(REVERSE_ALPHABET + "=")
        model = build_tiny_model(len(tokenizer), args.use_moe, tokenizer)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        name = where = args.model_name_or_path
        kwargs = {"trust_remote_code": bool(args.trust_remote_code)}
        if name.endswith(".gguf"):  # transformers reads weights, tokenizer, chat template from it
            where, kwargs["gguf_file"] = os.path.split(os.path.abspath(os.path.expanduser(name)))
        try:
            tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kwargs)
        except Exception as e:  # missing files, offline hub, unknown architecture: one line
            raise TrainerError(f"--model_name_or_path {name}: {one_line(e)}") from None
        if "gguf_file" in kwargs:
            model = plain_model(model)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        if args.use_moe and not is_moe(model):
            raise TrainerError(f"--use_moe 1 but {name} is a dense {model.config.model_type}")
    model.to(device=device, dtype=torch.float32)  # master weights; --dtype computes (autocast)
    if args.cast_lm_head_to_fp32 and args.dtype != "float32":
        cast_lm_head_to_fp32(model)
    disable_dropout(model)
    check_output_head(model)
    auto = args.gradient_checkpointing == -1 and args.model_name_or_path
    if args.gradient_checkpointing == 1 or auto:
        model.activation_checkpointing_enable({"use_reentrant": False})  # checkpoint()'s kwargs
    return model, tokenizer

def plain_model(model):
    """Read from GGUF, a model holds dequantized fp32 weights but keeps the quantizer's mark, which
    save_pretrained refuses: rebuilt without it, it saves (and checkpoints) as plain safetensors."""
    from transformers import AutoModelForCausalLM
    del model.config.quantization_config
    plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    return plain

@torch.no_grad()
def check_output_head(model):
    """Log-probs come from lm_logits(the decoder's last hidden state): refuse a model whose forward
    computes its logits otherwise."""
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = (torch.arange(3, 11, device=model.device) * 7919 % vocab)[None]      # 8 arbitrary tokens
    was_training = model.training
    last, out = forward_last_hidden(model.eval(), input_ids=ids, use_cache=False)
    model.train(was_training)
    ours, theirs = lm_logits(model, last[:, -1:]).float(), out.logits.float()
    if not torch.allclose(ours, theirs, rtol=1e-2, atol=1e-2 * theirs.abs().max().item()):
        gap = (ours - theirs).abs().max().item()
        raise TrainerError(f"{type(model).__name__}'s forward post-processes its logits in a way "
                           f"train_grpo.lm_logits does not (max difference {gap:.3g}); add it "
                           "there")

def forward_last_hidden(model, **inputs):
    """model(**inputs) (through its wrapper) and its decoder's last hidden state, caught by a hook:
    output_hidden_states would keep every layer's at once. logits_to_keep=1: the model's own lm_head
    runs on the last position only ([rows, 1, V], not [rows, P+T, V])."""
    caught = []
    hook = unwrap(model).get_decoder().register_forward_hook(
        lambda module, args, out: caught.append(out.last_hidden_state))
    try:
        out = model(**inputs, logits_to_keep=1)
    finally:
        hook.remove()
    return caught[0], out

class Fp32Linear(torch.nn.Linear):
    """--cast_lm_head_to_fp32: the model's own lm_head, z = float(h) @ float(W)^T under any autocast
    (bf16 autocast rounds h and W to 8 bits of mantissa first: the largest source of sampler/trainer
    mismatch). generate and lm_logits use it; its state_dict is the Linear's, a tied head tied."""
    def forward(self, hidden):
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return torch.nn.functional.linear(hidden.float(), self.weight.float(), bias)

def cast_lm_head_to_fp32(model):
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:  # a subclass's own forward would be lost
        raise TrainerError(f"--cast_lm_head_to_fp32: {type(model).__name__}'s lm_head is a "
                           f"{type(head).__name__}, not a torch.nn.Linear")
    head.__class__ = Fp32Linear  # the same module and parameters, an fp32 forward
    return model

# The largest tensor of a step is one chunk's logits, [tokens, V]: bounded in bytes, not tokens
# (1,024 tokens x 151,936 would be 622 MB in fp32, 2.5x that with its gradient)
LOGITS_BUDGET_MIB = 64

def auto_chunk_tokens(vocab_size, budget_mib=LOGITS_BUDGET_MIB):
    # tokens = budget / (V x 4 bytes of fp32 logits), at least 1
    return max(1, budget_mib * 2**20 // (vocab_size * 4))

def disable_dropout(model):
    """Dropout would make log-probs noisy (ratio != 1, KL != 0 at equal weights): every dropout
    probability is set to 0 (module attributes only; the saved config keeps its own)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)

def sft_warmup(model, tokenizer, train_rows, args, device, rank, world):
    """Built-in task: supervised steps so the tiny model earns some reward, batch_size rows a step
    on any number of ranks (the same warm start); fp16 scaling, clip at 1, skips as in GRPO."""
    if args.batch_size < world:  # a rank with no row would have no loss (and DDP no gradient)
        raise TrainerError(f"the supervised warm-up shares --batch_size {args.batch_size} rows "
                           f"among {world} ranks, one at least each: use --batch_size >= {world} "
                           "or --sft_warmup_steps 0")
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_learning_rate)
    scaler = loss_scaler(args.dtype, device)
    state, rng = TrainState(), random.Random(args.seed + 7)
    for _ in tqdm(range(args.sft_warmup_steps), desc="sft warmup", disable=rank != 0, leave=False):
        picks = [rng.randrange(len(train_rows)) for _ in range(args.batch_size)]
        rows = [train_rows[i] for i in picks[rank::world]]
        ids, am, _ = tokenize_prompts(tokenizer, [r["prompt"] for r in rows], args.max_prompt_len,
                                      device)
        answers = [tokenizer(r["answer"], add_special_tokens=False).input_ids for r in rows]
        target = torch.tensor([a + [tokenizer.eos_token_id] for a in answers], device=device)
        with autocast(args, device):
            logps, _, aux = completion_logps(
                model, torch.cat([ids, target], 1), torch.cat([am, torch.ones_like(target)], 1),
                target.shape[1], chunk_size=args.logp_chunk_size, with_entropy=False)
        # the whole batch's token mean however it is split (DDP averages; answers: equal length)
        loss = -logps.sum() * world / (args.batch_size * target.shape[1])
        if aux is not None:
            loss = loss + aux * unwrap(model).config.router_aux_loss_coef
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        grad_norm = clip_grad_norm(unwrap(model), 1.0)
        in_a_row, state.bad_in_a_row = state.bad_in_a_row, 0  # as in a GRPO step (one update)
        if update_is_finite(scaler, state, loss.item(), grad_norm, device, in_a_row):
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        if state.bad_in_a_row >= 3:
            raise TrainerError("supervised warm-up: loss or grad norm not finite for 3 steps in a "
                               "row")
    if state.skipped_steps and rank == 0:
        print(f"supervised warm-up: {state.skipped_steps} of {args.sft_warmup_steps} steps skipped "
              "(loss or grad norm not finite; under fp16 the loss scale was still falling)")

# --- Reward functions: the two ways one is called (per sample; TRL's batched form) ----------------
def reward_values(fn, completions, completion_ids, rows):
    """fn's value (or None) per sample: f(completion, **row) each, or TRL's batched form."""
    if "completions" not in inspect.signature(fn).parameters:
        values = []
        for i, (c, row) in enumerate(zip(completions, rows)):
            try:  # the row as the dataset has it ('prompt': the rendered text the policy saw)
                values.append(call_reward(fn, c, **{k: v for k, v in row.items()
                                                    if k != DATASET_PROMPT}))
            except Exception as e:
                raise TrainerError(f"reward {fn.__name__} raised {sample_name(i, c, row)}: "
                                   f"{type(e).__name__}: {e}") from None
        return values
    # TRL's call: f(prompts, completions, completion_ids, **other columns), each a list; a chat
    # prompt stays messages, its prefill moved to its completion [{"role": "assistant", ...}]
    try:
        prompts = [r.get(DATASET_PROMPT, r["prompt"]) for r in rows]
        if not isinstance(prompts[0], str):  # conversational
            prompts = [p[:-1] if p[-1]["role"] == "assistant" else p for p in prompts]
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        columns = {k: [r[k] for r in rows] for k in rows[0]
                   if k not in ("prompt", "completion", "completion_ids", DATASET_PROMPT)}
        values = call_reward(fn, **columns, prompts=prompts, completions=completions,
                             completion_ids=completion_ids)
    except Exception as e:
        raise TrainerError(f"reward {fn.__name__} raised on this step's {len(rows)} samples: "
                           f"{type(e).__name__}: {e}") from None
    values = values.tolist() if hasattr(values, "tolist") else values  # an array or a tensor
    if not isinstance(values, (list, tuple)) or len(values) != len(rows):
        raise TrainerError(f"reward {fn.__name__} returned {values!r:.40}, not a list of "
                           f"{len(rows)} values (one per completion, TRL's batched form)")
    return values

def sample_name(i, completion, row):
    return f"on sample {i} (prompt {row['prompt'][-60:]!r}, completion {completion[:60]!r})"

def call_reward(fn, /, *args, **kwargs):
    # only the keywords fn names (all if it takes **kwargs); positional-only: a column may be "fn"
    params = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)

# --- The loop's tools: data order, optimizer, schedule, loss scale, micro-batches, decoding -------
def set_up(args, rank, world, device):
    """Seeds; the bare policy, its DDP/FSDP `model`, tokenizer, task, data order; the warm-up."""
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
    policy, tokenizer = load_model_and_tokenizer(args, device)
    task = load_task(args, tokenizer, world)
    train_rows, eval_rows = task[:2]
    if rank == 0:  # what the run trains on, said as it starts: the split, a task's defaults
        print(f"{len(train_rows)} training prompts; {len(eval_rows)} held-out prompts, never "
              "trained on")
        if args.dataset in TASK_DEFAULTS:
            print(f"--dataset {args.dataset} sizes in effect (the task's defaults unless typed): "
                  + ", ".join(f"--{n} {getattr(args, n)}" for n in TASK_DEFAULTS[args.dataset]))
    if not eval_rows:
        if rank == 0 and args.eval_interval > 0:
            print("no held-out prompts (an empty test split, or a file under 10 rows): no eval")
        args.eval_interval = 0
    prompt_order = DistributedSampler(range(len(train_rows)), num_replicas=world, rank=rank,
                                      shuffle=True, seed=args.seed, drop_last=True)
    model = policy
    if world > 1:
        model = shard_fsdp(policy, args, world) if args.fsdp else wrap_ddp(policy, device)
    if not args.model_name_or_path and args.sft_warmup_steps > 0:
        # deterministic, so a resumed run redoes it and gets the same reference model
        sft_warmup(model, tokenizer, train_rows, args, device, rank, world)
    return policy, model, tokenizer, task, prompt_order

def next_prompts(prompt_order, train_rows, state, batch_size):
    """Stage 1: this rank's B prompts, in the DistributedSampler's order (a new one each epoch)."""
    if state.sampler_pos + batch_size > len(prompt_order):  # len: this rank's share of an epoch
        state.sampler_epoch, state.sampler_pos = state.sampler_epoch + 1, 0
    prompt_order.set_epoch(state.sampler_epoch)
    order = list(prompt_order)[state.sampler_pos:state.sampler_pos + batch_size]
    state.sampler_pos += batch_size
    return [train_rows[i] for i in order]

def build_optimizer(policy, args):
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate,
                                  weight_decay=args.weight_decay)

    return optimizer, torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda updated: lr_factor(updated, args))

def loss_scaler(dtype, device):
    # fp16: dynamic loss scaling (bf16 has fp32's exponent range and needs none); inert otherwise
    return torch.amp.GradScaler(torch.device(device).type, enabled=dtype == "float16")

def auto_micro_batch(rows, width, args):
    """Tiny model: all rows; else the largest divisor of rows within --micro_batch_tokens."""
    if not args.model_name_or_path:
        return rows
    fits = [d for d in range(1, rows + 1) if rows % d == 0 and d * width <= args.micro_batch_tokens]
    return max(fits or [1])

def plain_generate(policy, input_ids, attention_mask, tokenizer, max_gen_len, eos, sampler,
                   static_cache):
    """policy.generate's new tokens [rows, T] in eval mode, sampled by sampler alone (None: greedy),
    not the checkpoint's generation_config. static_cache: compiled decode (reading the weights)."""
    from transformers import GenerationConfig, LogitsProcessorList
    # generate's own sampling off (top_k 0, not its default 50); greedy: none (else it warns)
    off = dict(temperature=1.0, top_p=1.0, top_k=0) if sampler else {}
    config = GenerationConfig(max_new_tokens=max_gen_len, do_sample=sampler is not None, **off,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
                              bos_token_id=tokenizer.bos_token_id,
                              cache_implementation="static" if static_cache else None)
    # the compiled decode is specialized to the cache's shape: widths in steps of 64, not 1
    if static_cache:
        pad = -input_ids.shape[1] % 64
        input_ids = torch.nn.functional.pad(input_ids, (pad, 0), value=tokenizer.pad_token_id)
        attention_mask = torch.nn.functional.pad(attention_mask, (pad, 0), value=0)
    was_training, checkpoint_config = policy.training, policy.generation_config
    policy.eval()
    policy.generation_config = GenerationConfig()  # generate() fills unset fields from this
    try:
        with gathered(policy):
            processors = LogitsProcessorList([sampler] if sampler else [])
            out = policy.generate(input_ids=input_ids, attention_mask=attention_mask,
                                  generation_config=config, logits_processor=processors)
    finally:
        policy.generation_config = checkpoint_config
        policy.train(was_training)
    return out[:, input_ids.shape[1]:]

def eos_token_ids(model, tokenizer):
    """The ids that end a completion: the tokenizer's EOS, the generation config's (Llama-3: 3)."""
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    declared = declared if isinstance(declared, (list, tuple)) else [declared]
    return sorted({i for i in [tokenizer.eos_token_id, *declared] if i is not None})

def completion_token_ids(completion_ids, mask):
    # each completion's tokens up to and including its EOS, as lists (what TRL passes rewards)
    return [ids[m.bool()].tolist() for ids, m in zip(completion_ids, mask)]

def decode_completions(tokenizer, ids, rows):
    # after its chat prompt's prefill if any: as TRL, rewards and eval see the whole message
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    return [chat_prefill(row) + text for row, text in zip(rows, texts)]

# --- Processes and precision: torchrun, DDP, FSDP2, autocast --------------------------------------
def setup_distributed(args):
    """(rank, world, device): torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; `python` is one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        return 0, 1, torch.device(auto if args.device == "auto" else args.device)
    use_cuda = torch.cuda.is_available() and args.device != "cpu"
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device

def unwrap(model):
    # DDP wraps the policy; FSDP2's fully_shard changes it in place (nothing to unwrap)
    return model.module if isinstance(model, DDP) else model

def is_fsdp(model):
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)

class gathered:
    """Under FSDP2: every layer's full parameters for the whole rollout (one all-gather per layer,
    instead of one per layer per generated token), sharded again after. Elsewhere: nothing."""
    def __init__(self, model):
        from torch.distributed.fsdp import FSDPModule
        self.modules = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def __enter__(self):
        for m in self.modules:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()

    def __exit__(self, *exc):
        for m in self.modules:
            m.reshard()
            m.set_reshard_after_forward(m is not self.modules[0], recurse=False)  # root: never

def autocast(args, device):
    # fp32 weights, --dtype matmuls: a 1e-6 step on a bf16 weight of 0.02 would round away
    dtype = getattr(torch, args.dtype)
    return torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32)

# GradScaler halves an fp16 loss scale on each overflow, here never below this one: an overflow at
# scale 1 is the gradient's own, not the scale's
MIN_LOSS_SCALE = 1.0

def use_static_cache(args, device):
    on_cuda = torch.device(device).type == "cuda"
    return args.rollout_cache == "static" or (args.rollout_cache == "auto" and on_cuda)

def wrap_ddp(model, device):
    """The graph forward goes through it (its hooks all-reduce gradients), generate() not. One
    module per expert needs find_unused_parameters (Qwen3-MoE fuses them: zero gradient slices)."""
    per_expert_modules = any(isinstance(m, torch.nn.ModuleList) and name.endswith("experts")
                             for name, m in model.named_modules())
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
               find_unused_parameters=per_expert_modules)

def shard_fsdp(model, args, world):
    """FSDP2 units: each decoder layer, then the root; 1/world of each on a rank. Forward gathers
    the weights in --dtype (fp32 masters), backward reduce-scatters the gradients in fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(next(model.parameters()).device.type, (world,))
    compute = getattr(torch, args.dtype)
    mp = MixedPrecisionPolicy(param_dtype=None if compute == torch.float32 else compute,
                              reduce_dtype=torch.float32)
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model

def clip_grad_norm(model, max_norm):
    """The global grad norm (FSDP's DTensor made the world's), clipped to max_norm (0: no clip)."""
    max_norm = max_norm if max_norm > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

def sync_gradients(model, on):
    """Gradient accumulation: DDP all-reduces, FSDP reduce-scatters, only in a backward with on."""
    if isinstance(model, DDP):
        model.require_backward_grad_sync = on
    elif is_fsdp(model):  # FSDP accumulates unsharded gradients until then
        model.set_requires_gradient_sync(on)

def update_is_finite(scaler, state, loss, grad_norm, device, in_a_row):
    """Stage 13, one world decision: True when no rank's loss or grad norm is inf/NaN. A skipped
    update is counted and (fp16) halves every rank's scale; a non-finite loss, or an overflow at
    MIN_LOSS_SCALE, makes the step failing: bad_in_a_row = in_a_row (failing steps before) + 1."""
    bad_loss, bad_norm = world_sum(not math.isfinite(loss), not torch.isfinite(grad_norm),
                                   device=device)
    if bad_loss + bad_norm == 0:
        return True
    state.skipped_steps += 1
    if bad_loss or not (scaler.is_enabled() and scaler.get_scale() > MIN_LOSS_SCALE):
        state.bad_in_a_row = in_a_row + 1
    if scaler.is_enabled():
        # fp16: every rank halves alike (its own check may see no inf), restarting the growth count
        scaler.update(max(scaler.get_scale() * scaler.get_backoff_factor(), MIN_LOSS_SCALE))
        scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": 0})
    return False

def full_state_dict(model, every_rank=False):
    """The whole model's tensors; FSDP: a collective, to rank 0's CPU or every rank's device."""
    if not is_fsdp(model):
        return unwrap(model).state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank)
    return get_model_state_dict(model, options=options)

def stop_if_failing(args, state, step):
    if state.bad_in_a_row >= 3:
        raise TrainerError(f"step {step}: loss not finite, or gradients overflowing at the "
                           f"smallest loss scale, for 3 steps in a row; stopping (last good "
                           f"checkpoint: {find_checkpoint(args.save_dir) or 'none'})")

def barrier():
    if dist.is_initialized():
        dist.barrier()

def world_sum(*values, device="cpu"):
    """Each value summed over all ranks in one all-reduce (fp64); alone: as is."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()

def world_max(*values, device="cpu"):
    """Each value's largest over all ranks in one all-reduce (fp64); alone: as is."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()

# --- Checkpoints (stage 14): HF weights + trainer state, a temp dir renamed when whole ------------
def rng_state():
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state

def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])  # its keys as a list: numpy makes them uint32 again
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])

def save_checkpoint(save_dir, step, model, tokenizer, trainer_state, rank, optimizer_shard=None):
    """save_dir/checkpoint-<step>/: the whole model (from_pretrained loads it), trainer_state.pt,
    rng_state_<rank>.pt, under FSDP optimizer_<rank>.pt (each rank's shard of AdamW's state)."""
    weights = full_state_dict(model)  # a collective under FSDP: every rank takes part
    final = os.path.join(save_dir, f"checkpoint-{step}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    torch.save(rng_state(), os.path.join(tmp, f"rng_state_{rank}.pt"))
    if optimizer_shard is not None:
        torch.save(optimizer_shard, os.path.join(tmp, f"optimizer_{rank}.pt"))
    if rank == 0:
        save_pretrained(unwrap(model), tokenizer, weights, tmp)
        torch.save(trainer_state, os.path.join(tmp, "trainer_state.pt"))
    barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # a crash before this line leaves the previous checkpoint as it was
    barrier()
    return final

def save_pretrained(model, tokenizer, weights, where):
    """A plain transformers folder (safetensors), without its "Writing model shards" bar."""
    from transformers.utils import logging as hf_logging
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(where, state_dict=weights, safe_serialization=True)
        tokenizer.save_pretrained(where)
    finally:
        if bars:
            hf_logging.enable_progress_bar()

def find_checkpoint(save_dir):
    done = [p for p in glob.glob(os.path.join(save_dir, "checkpoint-*"))
            if re.fullmatch(r"checkpoint-\d+", os.path.basename(p))]
    return max(done, key=lambda p: int(p.rsplit("-", 1)[1]), default=None)

def load_weights(model, ckpt, trust_remote_code=False):
    """Checkpoint weights into model (of the same shapes), read by from_pretrained: its loader fuses
    MoE experts back (one tensor each on disk, one per layer in memory)."""
    from transformers import AutoModelForCausalLM
    if not os.path.isfile(os.path.join(ckpt, "model.safetensors")):
        raise TrainerError(f"checkpoint {ckpt} has no model.safetensors")
    try:
        saved = AutoModelForCausalLM.from_pretrained(
            ckpt, dtype=next(model.parameters()).dtype, trust_remote_code=trust_remote_code
        ).state_dict()
    except Exception as e:
        raise TrainerError(f"checkpoint {ckpt} could not be loaded: {one_line(e)}") from None
    own = model.state_dict()
    shape = lambda weights, k: tuple(weights[k].shape) if k in weights else "absent"
    for k in [*saved, *own]:
        if shape(saved, k) != shape(own, k):
            raise TrainerError(f"checkpoint {ckpt} is from another model: {k} is "
                               f"{shape(saved, k)} there, {shape(own, k)} here")
    if is_fsdp(model):  # each rank keeps its shard of the full tensors
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        set_model_state_dict(model, saved, options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(saved)

def save(args, trainer, scheduler, state, rank):
    # DDP: rank 0 saves AdamW; FSDP: each rank its shard, as local tensors (weights_only loads)
    optimizer, shard = trainer.optimizer.state_dict(), None
    if is_fsdp(trainer.model):
        plain = lambda st: {k: v.to_local() if hasattr(v, "to_local") else v for k, v in st.items()}
        shard = {**optimizer, "state": {i: plain(st) for i, st in optimizer["state"].items()}}
    trainer_state = {**dataclasses.asdict(state), "scheduler": scheduler.state_dict(),
                     "scaler": trainer.scaler.state_dict(),  # fp16's scale, its good-step count
                     "optimizer": None if shard is not None else optimizer}
    save_checkpoint(args.save_dir, state.step, trainer.model, trainer.tokenizer, trainer_state,
                    rank, optimizer_shard=shard)

def start_or_resume(args, trainer, scheduler, eval_rows, score, eval_key, rank):
    """A fresh start (empty log, per-rank sampling seeds, the eval before any update) or a resume
    from --resume's checkpoint: the loop state, the metrics file and --report_to's (send, close)."""
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    metrics_path = os.path.join(args.save_dir, "metrics.jsonl")
    ckpt = find_checkpoint(args.save_dir) if args.resume == "auto" else (args.resume or None)
    if ckpt:
        state = resume(args, ckpt, trainer, scheduler, rank, metrics_path)
        return state, metrics_path, open_report(args, rank, resumed_at=state.step)
    report = open_report(args, rank)
    state = TrainState.initial(args)
    # ranks sample differently; RNG no longer depends on the warmup
    torch.manual_seed(args.seed + 1 + rank)
    random.seed(args.seed + 1 + rank)
    if rank == 0:
        open(metrics_path, "w").close()
    if args.eval_interval > 0:
        acc = evaluate(unwrap(trainer.model), trainer.tokenizer, eval_rows, score, args, rank,
                       trainer.world, trainer.device)
        log_metrics(metrics_path, {"step": 0, eval_key: acc}, rank, report[0])
        if rank == 0:
            print(f"{eval_key} before GRPO: {acc:.3f}")
    return state, metrics_path, report

def resume(args, ckpt, trainer, scheduler, rank, metrics_path):
    """Restore all a checkpoint holds (this rank's RNG too); trim the log to the checkpoint."""
    policy, optimizer = unwrap(trainer.model), trainer.optimizer
    load_weights(policy, ckpt, trust_remote_code=bool(args.trust_remote_code))

    def load(name, why=""):  # weights_only: a checkpoint holds data, never code to run
        if not os.path.isfile(os.path.join(ckpt, name)):
            raise TrainerError(f"checkpoint {ckpt} has no {name}{why}")
        return torch.load(os.path.join(ckpt, name), map_location="cpu", weights_only=True)
    saved = load("trainer_state.pt")
    optimizer_state = saved.pop("optimizer")
    if is_fsdp(policy):  # this rank's shard, its plain tensors DTensors like their parameters again
        from torch.distributed.tensor import DTensor
        optimizer_state = load(f"optimizer_{rank}.pt",
                               " (it was written without --fsdp 1, or by fewer ranks)")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for i, st in optimizer_state["state"].items():
            p = params[int(i)]
            for k, v in st.items():
                if isinstance(p, DTensor) and v.dim() > 0:
                    st[k] = DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape,
                                               stride=p.stride())
    elif optimizer_state is None:
        raise TrainerError(f"checkpoint {ckpt} was written under --fsdp 1; resume it with --fsdp 1")
    optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(saved.pop("scheduler"))
    scaler_state = saved.pop("scaler", {})
    if scaler_state:  # {} when written without fp16; a disabled scaler ignores it
        trainer.scaler.load_state_dict(scaler_state)
    renamed = {"entropy_coef": "c", "next_alpha": "alpha", "entropy_coef_applied": "alpha"}
    for old, new in renamed.items():
        if old in saved:  # a checkpoint written before the fields' renames
            saved[new] = saved.pop(old)
    state = TrainState(**saved)
    set_rng_state(load(f"rng_state_{rank}.pt", " (it was written by fewer ranks)"))
    if rank == 0:  # keep the log of the steps this checkpoint contains, drop any logged after it
        kept = ([ln for ln in open(metrics_path) if json.loads(ln).get("step", 0) <= state.step]
                if os.path.exists(metrics_path) else [])
        with open(metrics_path, "w") as f:
            f.writelines(kept)
        print(f"resumed from {ckpt} at step {state.step}")
    return state

# --- Evaluation and reporting ---------------------------------------------------------------------
def step_metrics(trainer, state, rewards, advantages, mask, no_eos, totals, sampled, prompts_cut,
                 G, num_items):
    """The step's record: world values (sums and counts over ranks, or the world's min and max).
    With mu > 1 it mixes two updates: loss, policy_loss, kl, clip_ratio and grad_norm are the last
    update's (`totals`), entropy and the sampler mismatch the first's (`sampled`: the policy that
    sampled). entropy, clip_ratio and the mismatch cover the rows trained on (rows_trained, all
    ranks; all rows unless zero-advantage rows are skipped); a step training no token has none."""
    world, device = trainer.world, trainer.device
    grouped = rewards.view(-1, G)
    zero_std = (grouped.amax(1) == grouped.amin(1)).float().mean()  # groups whose rewards all tie
    (r_mean, r_sq, a_mean, a_sq, c_len, trunc, zero_std, loss, pl, kl, clip, aux, cut, trained,
     tokens) = world_sum(rewards.mean(), (rewards ** 2).mean(), advantages.mean(),
                         (advantages ** 2).mean(), mask.sum(1).float().mean(),
                         no_eos.float().mean(), zero_std, totals["loss"], totals["policy_loss"],
                         totals["kl_sum"], totals["clip"], totals["aux"], prompts_cut,
                         totals["rows"], totals["tokens"], device=device)
    state.truncated_prompts += int(cut)
    # the policy that sampled against the sampler, per masked token trained on
    gap, gap_mask = (torch.cat(sampled[k]) if sampled[k] else torch.zeros(0)
                     for k in ("gap", "gap_mask"))  # [trained, T]
    mismatch = sampler_mismatch(gap, gap_mask, device)
    record = {"reward": r_mean / world,
              "reward_std": math.sqrt(max(r_sq / world - (r_mean / world) ** 2, 0.0)),
              "frac_reward_zero_std": zero_std / world,
              "advantage_std": math.sqrt(max(a_sq / world - (a_mean / world) ** 2, 0.0)),
              "loss": loss / world, "policy_loss": pl / world,
              "kl": kl / max(num_items, 1.0),  # a masked mean over all tokens of all ranks
              "entropy": state.world_entropy, "entropy_coef": state.c,
              "clip_ratio": clip / max(tokens, 1.0), "completion_len": c_len / world,
              "truncated_frac": trunc / world, "rows_trained": int(trained), **mismatch,
              "skipped_steps": state.skipped_steps, "skipped_steps_in_a_row": state.bad_in_a_row,
              "truncated_prompts": state.truncated_prompts}
    if tokens == 0:  # no token trained: no entropy, clipping or mismatch was measured
        for k in ("entropy", "clip_ratio", *mismatch):
            del record[k]
    if is_moe(trainer.model):
        record["aux_loss"] = aux / world
    return record

def sampler_mismatch(gap, mask, device="cpu"):
    """The five mismatch metrics over the masked tokens of all ranks, from gap [rows, T] = the
    trainer's old log-prob - the sampler's: |gap| (mean, max), rho = exp(gap) (min, mean, max)."""
    on = mask.bool()
    diff, rho = gap[on].abs(), gap[on].exp()
    n, diff_sum, ratio_sum = world_sum(on.sum(), diff.sum(), rho.sum(), device=device)
    # a rank without masked tokens takes no part in the world's max and min
    local = (diff.max(), rho.max(), -rho.min()) if on.any() else (0.0, -math.inf, -math.inf)
    diff_max, ratio_max, neg_ratio_min = world_max(*local, device=device)
    return {"sampler_logp_diff_mean": diff_sum / max(n, 1.0), "sampler_logp_diff_max": diff_max,
            "is_ratio_min": -neg_ratio_min, "is_ratio_mean": ratio_sum / max(n, 1.0),
            "is_ratio_max": ratio_max}

@torch.no_grad()
def evaluate(policy, tokenizer, eval_rows, score, args, rank, world, device, batch=256):
    """The world mean of score() over greedy completions of the held-out rows. Every rank runs as
    many rollouts (FSDP: collectives) as the busiest: one out of rows generates for a stand-in."""
    mine = eval_rows[rank::world]
    correct = 0.0
    for b in range(int(world_max(math.ceil(len(mine) / batch), device=device)[0])):
        rows = mine[b * batch:(b + 1) * batch]
        prompts = [r["prompt"] for r in rows] or [eval_rows[0]["prompt"]]
        ids, am, _ = tokenize_prompts(tokenizer, prompts, args.max_prompt_len, device)
        with autocast(args, device):
            comp, mask, *_ = rollout(policy, ids, am, tokenizer, max_gen_len=args.max_gen_len,
                                     do_sample=False, static_cache=use_static_cache(args, device))
        if rows:  # the ids as generated, EOS included (what the rewards get in training)
            ids = completion_token_ids(comp, mask)
            correct += sum(score(decode_completions(tokenizer, ids, rows), rows, ids))
    c, n = world_sum(correct, len(mine), device=device)
    return c / max(n, 1)

def reset_peak_memory(device):
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

def peak_memory_gib(device):
    """CUDA: the most allocated since this step began. CPU: the process's peak resident memory."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20                # KiB on Linux

def show_progress(bar, record, args, state, cut_before, eval_key, world):
    """The progress bar's line (rank 0); a warning the first time a step cuts a prompt."""
    if state.truncated_prompts > cut_before and not getattr(bar, "warned_cut", bar.disable):
        bar.warned_cut = True  # once a run (rank 0)
        print(f"warning: prompts longer than --max_prompt_len {args.max_prompt_len} are "
              "left-truncated")
    rows_per_step = args.batch_size * args.num_generations * world
    bar.set_postfix(reward=f"{record['reward']:.3f}", eval=record.get(eval_key, ""),
                    gen=f"{record['generate_share']:.0%}", mem=f"{record['peak_mem_gib']:.1f}G",
                    is_max=f"{record.get('is_ratio_max', math.nan):.3f}",
                    rows=f"{record['rows_trained']}/{rows_per_step}")

def log_metrics(metrics_path, record, rank, report=None):
    """Rank 0 appends the record to metrics.jsonl and hands it to --report_to's logger, if any."""
    if rank == 0:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if report is not None:
            report(record)

def open_report(args, rank, resumed_at=None):
    """--report_to's (send(record), close()) on rank 0, else (None, None). A resume continues the
    run: TensorBoard purges points after the checkpoint; wandb reopens it by the id in save_dir."""
    if args.report_to == "none" or rank != 0:
        return None, None
    name = args.run_name or os.path.basename(os.path.normpath(args.save_dir))
    if args.report_to == "wandb":
        import wandb
        id_file = os.path.join(args.save_dir, "wandb_run_id")
        if resumed_at is None or not os.path.isfile(id_file):
            with open(id_file, "w") as f:
                f.write(os.urandom(4).hex())  # not from the seeded RNGs: the run stays reproducible
        run = wandb.init(project="train_grpo", name=name, dir=args.save_dir, resume="allow",
                         config=dataclasses.asdict(args), id=open(id_file).read().strip())
        def send_to_wandb(record):
            run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        return send_to_wandb, run.finish
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(os.path.join(args.save_dir, "tensorboard", name),
                           purge_step=None if resumed_at is None else resumed_at + 1)

    def send(record):
        for k, v in record.items():
            if k != "step":
                writer.add_scalar(k, v, record["step"])
        writer.flush()
    return send, writer.close

def finish(args, policy, tokenizer, state, metrics_path, eval_key, started, rank, source=None):
    """Rank 0: final/, the last checkpoint's weights as hard links (a copy where links fail: they
    are serialized once) and copies of its config and tokenizer files, and one summary line.
    source: the checkpoint of the weights when this run trained nothing, else this run's last."""
    if rank != 0:
        return
    where = find_checkpoint(args.save_dir)
    if state.step == args.max_steps:
        ckpt = source or os.path.join(args.save_dir, f"checkpoint-{state.step}")
        where = os.path.join(args.save_dir, "final")
        shutil.rmtree(where, ignore_errors=True)
        os.makedirs(where)
        for name in [n for n in os.listdir(ckpt) if not n.endswith(".pt")]:
            src, dst = os.path.join(ckpt, name), os.path.join(where, name)
            # small files are copied: save_pretrained rewrites them in place (a link edits ckpt)
            link = os.link if name.endswith(".safetensors") else shutil.copy2
            try:
                link(src, dst)
            except OSError:  # a file system without hard links
                shutil.copy2(src, dst)
        print(f"saved {where}")
    evals = [(r["step"], r[eval_key]) for r in map(json.loads, open(metrics_path)) if eval_key in r]
    held_out = (f"held-out {eval_key} {evals[0][1]:.3f} (step {evals[0][0]}) -> {evals[-1][1]:.3f} "
                f"(step {evals[-1][0]})" if evals else "no held-out eval (--eval_interval 0)")
    print(f"done: step {state.step} of {args.max_steps} in {time.time() - started:.0f} s; "
          f"{held_out}; model: {where}")

# --- main -----------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    rank, world, device = setup_distributed(args)
    try:
        return train(args, rank, world, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

def cli(argv=None):
    """A problem with the user's input: one line `error: ...`, exit status 1 (a bad flag: 2)."""
    try:
        main(argv)
    except TrainerError as e:
        sys.stderr.write(f"error: {e}\n")  # one write: ranks' lines never interleave
        return 1
    return 0

if __name__ == "__main__":
    code = cli()
    if code == 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun, a finished run: leave without the interpreter's teardown, where gloo's threads
        # can abort it after all is saved (SIGABRT, "terminate called without an active exception")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
