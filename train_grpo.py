"""GRPO in one file: sample G completions per prompt, score them, and push up the ones that beat their group.

Read it top to bottom beside notebook.ipynb. First the config (`Args`), then one step (`grpo_step`: collect a
batch, then train on it) and its math, each formula in a comment and with a test in tests/. A line of '=' marks
where the step's math ends (its comment names the few formulas that live below). Below it is the plumbing the step
calls by name, and what runs the step: the loop, tasks and rewards, models, processes, flags, checkpoints, logging.

    python train_grpo.py                                          # offline: a tiny model, a built-in task
    torchrun --nproc_per_node 2 train_grpo.py --loss_type grpo    # 2 processes (gloo on CPU, nccl on GPU)
    python train_grpo.py --model_name_or_path HuggingFaceTB/SmolLM2-135M-Instruct --dataset compare_numbers

What this file leaves out, on purpose, to stay small:
- No vLLM. Rollouts use `model.generate` on the policy itself and sample the full distribution at
  --temperature, which is the distribution the ratio scores. There is no top-k or top-p.
- No FSDP. Every rank holds the whole model (DDP), so a model must fit on one GPU.
- Every row is trained, also a row whose advantage is 0. With beta = 0, no entropy bonus and a dense model it
  adds exactly 0 to the gradient, but skipping it would require the ranks to agree on how many micro-batches to run.
- No per-sample reward form. A reward function has TRL's batched signature.
"""

import argparse
import copy
import dataclasses
import gc
import glob
import importlib.util
import json
import math
import os
import random
import re
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint as recompute_in_backward
from torch.utils.data import DistributedSampler
from tqdm import tqdm


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")


# ---------------------------------------------------------------------------------------------------------------
# Config. Every field is a command-line flag: `--name value`. Its defaults are the built-in toy task's.
# ---------------------------------------------------------------------------------------------------------------
def flag(default, help, choices=None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class Args:
    # What to train.
    loss_type: str = flag("grpo", "objective and normalization (README: The math)", LOSS_TYPES)
    use_moe: int = flag(0, "1: the tiny model is a mixture of experts (a loaded one must be one); any MoE adds its "
                           "router loss", (0, 1))
    model_name_or_path: str = flag("", "hub name, local folder or .gguf file; empty: a tiny model built here")
    dataset: str = flag("", "compare_numbers, gsm8k, a hub dataset or a .jsonl/.json/.parquet file; "
                            "empty: the built-in reversal task")
    reward_funcs: str = flag("", "your rewards, comma-separated: file.py:name or a built-in name")
    reward_weights: str = flag("", "comma-separated weights of the rewards; empty: the task's own, or 1 each")
    trust_remote_code: int = flag(0, "1: let from_pretrained run the model repository's code", (0, 1))
    # Rollout.
    num_generations: int = flag(8, "G, completions sampled per prompt (a group)")
    batch_size: int = flag(16, "B, prompts per rank per step, so B*G rows")
    micro_batch_size: int = flag(0, "rows per forward and backward (the last may hold fewer); 0: all B*G rows")
    max_prompt_len: int = flag(256, "prompt tokens kept; a longer prompt loses its start")
    max_gen_len: int = flag(8, "L_max, new tokens per completion")
    temperature: float = flag(1.0, "sampling temperature; the log-probs are scored at the same one")
    mask_truncated_completions: int = flag(0, "1: a completion without EOS trains no token", (0, 1))
    share_prompt: int = flag(1, "1: a group's prompt goes through the model once, its G completions on its KV cache; "
                                "0: once per row", (0, 1))
    # Objective.
    beta: float = flag(0.0, "k3 KL coefficient; > 0 keeps a frozen reference model")
    epsilon: float = flag(0.2, "lower clip: the ratio is clipped at 1 - epsilon")
    epsilon_high: float = flag(-1.0, "upper clip (cispo: the weight cap); -1: epsilon (cispo: 5.0)")
    num_iterations: int = flag(1, "mu, updates per rollout")
    scale_rewards: str = flag("group", "advantage divisor: group std, batch std, or none", ("group", "batch", "none"))
    importance_sampling_level: str = flag("token", "sequence: one ratio per completion (GSPO)", ("token", "sequence"))
    # Log-probs and entropy.
    logp_chunk_size: int = flag(0, "tokens per lm_head chunk; 0: as many as fit 64 MiB of fp32 logits")
    entropy_coef: float = flag(0.0, "entropy bonus coefficient; adaptive: the start of c")
    use_adaptive_entropy: int = flag(0, "1: raise c while the entropy is under --entropy_target, else lower it", (0, 1))
    entropy_target: float = flag(0.2, "adaptive: the target world entropy, nats per token")
    entropy_coef_delta: float = flag(1e-4, "adaptive: how much c moves per step")
    entropy_coef_min: float = flag(0.0, "adaptive: the lowest c")
    entropy_coef_max: float = flag(0.005, "adaptive: the highest c")
    # Optimization.
    max_steps: int = flag(200, "GRPO steps")
    learning_rate: float = flag(2e-4, "AdamW learning rate")
    weight_decay: float = flag(0.0, "AdamW weight decay")
    lr_scheduler: str = flag("constant", "the schedule after the warmup", ("constant", "cosine"))
    warmup_steps: int = flag(0, "steps of linear learning-rate warmup")
    grad_clip: float = flag(1.0, "largest global grad norm; 0: no clipping")
    gradient_checkpointing: int = flag(0, "1: recompute each layer in backward to save memory", (0, 1))
    sft_warmup_steps: int = flag(200, "built-in task only: supervised steps before GRPO")
    sft_learning_rate: float = flag(1e-3, "learning rate of the supervised warmup")
    sft_batch_size: int = flag(16, "rows per supervised step over all ranks, so any world size trains on the same rows")
    # Bookkeeping.
    seed: int = flag(0, "seed of the model, the data order and the sampling")
    save_dir: str = flag("runs/grpo", "where metrics.jsonl, the checkpoints and final/ go")
    save_interval: int = flag(0, "write checkpoint-<step> every N steps; 0: only at the end")
    save_total_limit: int = flag(0, "keep the newest N checkpoints, deleting older ones once a newer is whole; 0: all")
    resume: str = flag("", "'auto' (the latest checkpoint in --save_dir) or a checkpoint folder")
    eval_interval: int = flag(50, "greedy held-out eval every N steps, at the last, and before a fresh run; 0: off")
    eval_size: int = flag(256, "held-out prompts")
    dtype: str = flag("float32", "compute dtype; weights and AdamW state stay float32",
                      ("float32", "bfloat16", "float16"))
    device: str = flag("auto", "auto, cpu or cuda", ("auto", "cpu", "cuda"))
    stop_after: int = flag(0, "stop after this step and its checkpoint; 0: run to --max_steps")
    report_to: str = flag("none", "also send metrics and completions here", ("none", "wandb", "tensorboard"))
    log_completions: int = flag(0, "1: every step's training completions of rank 0 go to completions.jsonl", (0, 1))
    num_completions_to_print: int = flag(3, "held-out completions printed at each eval")
    run_name: str = flag("", "the run's name in wandb or tensorboard; empty: the save_dir's name")

    def __post_init__(self):
        # cispo's epsilon_high is a cap on the weight min(rho, eps_h), not an offset from 1.
        if self.epsilon_high == -1.0:
            self.epsilon_high = 5.0 if self.loss_type == "cispo" else self.epsilon


# ---------------------------------------------------------------------------------------------------------------
# One GRPO step: collect a batch (stages 1-4, no graph), then train on it (stages 5-13).
# A fork that brings its completions from elsewhere passes its own collect (README: Fork the step).
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class TrainState:
    """What the loop carries from one step to the next. All of it goes into a checkpoint."""
    step: int = 0
    sampler_epoch: int = 0
    sampler_pos: int = 0
    entropy_coef: float = 0.0              # c, fixed at --entropy_coef or moved by the adaptive rule
    entropy_coef_applied: float = 0.0      # alpha, the entropy bonus coefficient the coming step applies
    world_entropy: float = float("nan")    # the last step's entropy over all ranks
    skipped_updates: int = 0               # optimizer updates skipped for a non-finite grad norm

    @classmethod
    def initial(cls, args):
        # The adaptive bonus waits for a measured entropy (alpha = 0 at step 1), as TRL does.
        alpha = 0.0 if args.use_adaptive_entropy else args.entropy_coef
        return cls(entropy_coef=args.entropy_coef, entropy_coef_applied=alpha)


@dataclass
class Run:
    """The models, optimizer and rewards a step uses. `model` is the DDP wrapper when there are several
    processes, else the policy."""
    model: torch.nn.Module
    ref_model: object        # a frozen copy of the policy as GRPO starts, only when beta > 0
    optimizer: object
    scheduler: object
    scaler: object           # torch.amp.GradScaler, active under float16 only
    tokenizer: object
    reward_fns: list
    weights: list
    world: int = 1
    device: str = "cpu"


@dataclass
class Batch:
    """This rank's B*G rows as a collect function hands them to train_on_batch: G completions of each prompt side
    by side, scored. A fork that brings its completions from elsewhere (a vLLM server, a replay buffer) builds one
    of these, and applies --mask_truncated_completions and --scale_rewards itself, as collect_batch does. The step's
    metrics read it: the per-function ones read rewards_per_func (NaN without it), and generate_time and
    prompts_cut are what the fork puts there."""
    input_ids: torch.Tensor        # [B*G, P + T], each left-padded prompt, then its completion
    attention_mask: torch.Tensor   # [B*G, P + T]
    completion_mask: torch.Tensor  # [B*G, T], m: 1 up to and including the first EOS (or 0 as masked), what trains
    advantages: torch.Tensor       # [B*G], A
    rewards: torch.Tensor          # [B*G], r
    completion_len: torch.Tensor   # [B*G], tokens up to and including the EOS, before --mask_truncated_completions
    truncated: torch.Tensor        # [B*G], True where a completion never emitted an EOS
    rewards_per_func: object = None  # [B*G, K], each reward function's value before its weight; NaN: None
    old_logps: object = None       # [B*G, T] without a graph, the sampler's; None: the policy's (stage 6)
    ref_logps: object = None       # [B*G, T] without a graph, the reference's; None: computed when beta > 0
    prompts_cut: int = 0           # prompts that lost their start to --max_prompt_len
    generate_time: float = 0.0     # seconds spent sampling


def grpo_step(args, run, prompt_rows, state, collect=None):
    """One step on this rank's B prompts: collect a batch, train on it, and return the step's metrics over all
    ranks and the batch. `collect(args, run, prompt_rows)` returns a Batch; collect_batch samples it."""
    if collect is None:
        collect = collect_batch
    started = time.time()
    reset_peak_memory(run.device)
    batch = collect(args, run, prompt_rows)
    update_stats = train_on_batch(args, run, batch, state)
    # The record (below the line) reads the batch, the update's numbers and the state, and changes no weight.
    return step_metrics(args, run, batch, state, update_stats, time.time() - started), batch


@torch.no_grad()
def collect_batch(args, run, prompt_rows):
    """Stages 1-4, without a graph: the prompts, the rollout, the rewards and the advantages."""
    device = torch.device(run.device)
    G = args.num_generations
    policy = unwrap(run.model)
    tokenizer = run.tokenizer

    # 1. Prompts. Each one is repeated G times, so the G rows of a group sit side by side. Each is rendered as text
    # (chat messages through the chat template) and tokenized left-padded; a prompt too long loses its start.
    group_rows = [row for row in prompt_rows for _ in range(G)]
    texts = [render_prompt(tokenizer, row) for row in prompt_rows]
    prompt_ids, prompt_mask, prompts_cut = tokenize_prompts(tokenizer, texts, args.max_prompt_len, device, G)

    # 2. Rollout. model.generate on the bare policy samples from softmax(z / temperature) and nothing else, since
    # that is the distribution the ratio scores. The mask keeps each completion up to and including its first EOS.
    # A group's G rows share one prompt, and causal attention makes its keys and values the same in each row. So with
    # --share_prompt the rollout prefills each prompt once and its G rows sample on that KV cache, except on CUDA,
    # whose static cache is made for every row. The model then sees at most B*(P - 1) + B*G*T tokens, not
    # B*G*(P + T - 1).
    started = time.time()
    with autocast(args, device):
        completion_ids, mask, truncated = rollout(policy, prompt_ids, prompt_mask, tokenizer,
                                                  max_gen_len=args.max_gen_len, temperature=args.temperature,
                                                  static_cache=device.type == "cuda",
                                                  group_size=G if args.share_prompt else 1)
    generate_time = time.time() - started

    # 3. Rewards. Each function gets what TRL gives it (the prompts, the decoded completions, their ids and the
    # dataset's columns); score_completions checks that each value is a finite number or None.
    completion_ids_list = completion_token_ids(completion_ids, mask)
    completions = tokenizer.batch_decode(completion_ids_list, skip_special_tokens=True)
    prompts = []
    for row, text in zip(prompt_rows, texts):
        prompts += [reward_prompt(row, text) for _ in range(G)]
    rewards_per_func = score_completions(run.reward_fns, prompts, completions, completion_ids_list, group_rows)
    rewards = compute_rewards(rewards_per_func, run.weights)

    # 4. Advantages: each reward against its group's.
    batch_std = world_std(rewards, device) if args.scale_rewards == "batch" else None
    advantages = compute_advantages(rewards, G, args.scale_rewards, batch_std).to(device)
    completion_len = mask.sum(1).float()
    if args.mask_truncated_completions:
        # The reward of a completion without EOS stands, but none of its tokens trains.
        mask = mask * (~truncated).unsqueeze(1)
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    # Built from the mask after that, as in TRL, so a silenced completion is not attended to either.
    attention_mask = torch.cat([prompt_mask, mask], 1)
    # The policy sampled these completions, so old_logps stays None: train_on_batch takes the policy's (stage 6).
    return Batch(input_ids=input_ids, attention_mask=attention_mask, completion_mask=mask, advantages=advantages,
                 rewards=rewards, completion_len=completion_len, truncated=truncated,
                 rewards_per_func=rewards_per_func, prompts_cut=prompts_cut, generate_time=generate_time)


def train_on_batch(args, run, batch, state):
    """Stages 5-13: the reference log-probs (beta > 0) and the old ones (mu > 1), then mu updates on the batch, each
    over S micro-batches, then the next step's entropy coefficient. It updates `state` and returns this rank's loss
    terms (the last update's) for the step's metrics."""
    device = batch.input_ids.device
    policy = unwrap(run.model)
    alpha = state.entropy_coef_applied
    mask = batch.completion_mask
    num_rows, T = mask.shape
    # Every rank runs the same S micro-batches. N, the masked tokens of the step over all ranks, is the step's.
    parts = micro_batches(num_rows, args.micro_batch_size)
    S = len(parts)
    N = world_sum(mask.sum(), device=device)[0]
    # A group's rows hold one prompt and attend to it causally, so its keys and values are the same in every row:
    # each prompt goes through the model once, into a KV cache its rows read (--share_prompt). Stages 5-7 decide
    # alike, so that the reference and old log-probs are the policy's to the bit. A checkpointed layer drops the cache
    # (replayed in backward, it would write it twice), so with gradient checkpointing every row takes its prompt.
    share_prompt = bool(args.share_prompt) and not policy.is_activation_checkpointing
    # 5. Reference log-probs, when beta > 0, unless the batch brings them.
    ref_logps = batch.ref_logps
    if ref_logps is None and run.ref_model is not None:
        ref_logps = logps_without_grad(run.ref_model, batch.input_ids, batch.attention_mask, T, parts, args,
                                       share_prompt)
    # 6. Old log-probs, unless the batch brings the sampler's. With mu > 1 they are the policy's before the first
    # update, kept fixed through all mu, so that the later updates' ratios move and clip.
    old_logps = batch.old_logps
    if old_logps is None and args.num_iterations > 1:
        old_logps = logps_without_grad(policy, batch.input_ids, batch.attention_mask, T, parts, args, share_prompt)

    update_stats = {"learning_rate": run.scheduler.get_last_lr()[0], "entropy_coef_applied": alpha, "N": N}
    entropy_sum = torch.zeros((), device=device)
    applied = False
    for iteration in range(args.num_iterations):
        sums = {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0, "clipped": 0.0, "aux": 0.0}
        for j, part in enumerate(parts):
            if isinstance(run.model, DDP):
                # DDP all-reduces the gradients in the last micro-batch's backward only.
                run.model.require_backward_grad_sync = j == S - 1
            m = mask[part]
            # A micro-batch's means weigh its share of the rows, so the last, shorter one weighs less.
            share = m.shape[0] / num_rows
            D = loss_divisor(args.loss_type, num_rows, m.shape[0], N, run.world, args.max_gen_len)
            # 7. Current log-probs, through the DDP wrapper so that backward syncs the gradients.
            # The entropy is measured on the first update, and kept in the graph only if a bonus uses it.
            # With a shared prompt, the prompt's gradient is the sum of its rows'.
            with autocast(args, device):
                logps, entropy, aux = completion_logps(
                    run.model, batch.input_ids[part], batch.attention_mask[part], T, temperature=args.temperature,
                    chunk_size=args.logp_chunk_size, entropy_grad=alpha != 0.0,
                    with_entropy=iteration == 0 or alpha != 0.0, share_prompt=share_prompt)
            # On-policy (mu = 1) the old log-probs are logp.detach(): the ratio is 1, and its gradient is dlogp.
            old = logps.detach() if old_logps is None else old_logps[part]
            ref = None if ref_logps is None else ref_logps[part]
            # 8-9. The per-token objective plus beta times the KL, normalized as --loss_type says (stage 9).
            loss, stats = policy_objective(logps, old, batch.advantages[part], m, loss_type=args.loss_type,
                                           epsilon=args.epsilon, epsilon_high=args.epsilon_high, divisor=D,
                                           ref_logps=ref, beta=args.beta,
                                           importance_sampling_level=args.importance_sampling_level)
            # 11. The bonus is the token mean of H over this micro-batch, whatever the loss type (TRL).
            if alpha != 0.0:
                loss = loss - alpha * share * (entropy * m).sum() / m.sum().clamp(min=1)
            # 12. A mixture of experts adds its router's load-balancing loss. With a shared prompt the routers see
            # each prompt's tokens but its last once per micro-batch, not once per row (forward_on_prompt_cache).
            if aux is not None:
                loss = loss + policy.config.router_aux_loss_coef * share * aux
                sums["aux"] += share * aux.detach()
            # 13. Gradients add up over the micro-batches. Under float16 the loss is scaled first.
            run.scaler.scale(loss).backward()
            sums["loss"] += loss.detach()
            sums["policy_loss"] += stats["policy_loss"]
            sums["kl"] += stats["kl_sum"]
            sums["clipped"] += stats["clipped_tokens"]
            if iteration == 0:
                entropy_sum += (entropy.detach() * m).sum()
        # 13. Clip the global grad norm, then one AdamW step. DDP gave every rank the same gradients and norm.
        run.scaler.unscale_(run.optimizer)
        grad_norm = clip_grad_norm(policy, args.grad_clip)
        if torch.isfinite(grad_norm):
            run.scaler.step(run.optimizer)
            applied = True
        else:
            state.skipped_updates += 1
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
    # The schedule moves once per step that updated the weights, so skipped steps do not use up the warmup.
    if applied:
        run.scheduler.step()

    # 11. The next step's entropy coefficient, from one world entropy: a sum and a count over all ranks.
    state.world_entropy = world_token_mean(entropy_sum, mask.sum(), device=device)
    if args.use_adaptive_entropy:
        state.entropy_coef, state.entropy_coef_applied = update_entropy_coef(
            state.entropy_coef, state.world_entropy, target=args.entropy_target, delta=args.entropy_coef_delta,
            coef_min=args.entropy_coef_min, coef_max=args.entropy_coef_max)
    update_stats.update(sums)
    update_stats["grad_norm"] = grad_norm.item()
    return update_stats


def micro_batches(num_rows, micro_batch_size):
    """The slices of the S micro-batches: micro_batch_size rows each, the last may hold fewer; 0: one of all rows.
    Every rank holds B*G rows, so every rank runs the same S."""
    micro = micro_batch_size or num_rows
    S = math.ceil(num_rows / micro)
    return [slice(j * micro, (j + 1) * micro) for j in range(S)]


# ---------------------------------------------------------------------------------------------------------------
# Stages 2-4. The completion mask, the rewards and the advantages.
# ---------------------------------------------------------------------------------------------------------------
def completion_mask(completion_ids, eos_token_id):
    # m_{i,t} = 1 for t <= the first EOS, else 0. The EOS itself is in the mask, so stopping is reinforced.
    eos = torch.as_tensor(eos_token_id, device=completion_ids.device)
    is_eos = torch.isin(completion_ids, eos)
    T = completion_ids.shape[1]
    never = torch.full_like(is_eos[:, 0], T, dtype=torch.long)
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), never)
    positions = torch.arange(T, device=completion_ids.device).expand_as(completion_ids)
    mask = (positions <= first_eos.unsqueeze(1)).long()
    return mask, ~is_eos.any(1)


def compute_rewards(rewards_per_func, weights):
    # r_i = sum_k w_k * reward_k(o_i), over the functions that score o_i. A None is NaN here and adds nothing,
    # as TRL's nansum. score_completions has checked that some function scores every completion.
    w = torch.tensor(weights, dtype=rewards_per_func.dtype)
    return (rewards_per_func * w).nansum(1).float()


def compute_advantages(rewards, num_generations, scale_rewards="group", batch_std=None):
    # A_i = (r_i - mean_group(r)) / (std_group(r) + 1e-4), the std with n - 1 as torch.std (and TRL).
    # "batch" divides by the std of every rank's rewards (batch_std), "none" does not divide.
    grouped = rewards.view(-1, num_generations)
    # A group whose rewards all tie gets exactly 0: the float32 mean of 8 copies of 0.2 is 0.2 + 1.5e-8.
    tied = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    centered = torch.where(tied, 0.0, grouped - grouped.mean(dim=1, keepdim=True))
    if scale_rewards == "group":
        centered = centered / (grouped.std(dim=1, keepdim=True) + 1e-4)
    elif scale_rewards == "batch":
        if batch_std is None:
            batch_std = rewards.std()
        centered = centered / (batch_std + 1e-4)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be group, batch or none, not {scale_rewards!r}")
    return centered.reshape(-1)


# ---------------------------------------------------------------------------------------------------------------
# Stages 5-7 and 10. Log-probs and entropy, through lm_head a chunk of tokens at a time.
# ---------------------------------------------------------------------------------------------------------------
def autocast(args, device):
    # Weights stay float32 and matmuls run in --dtype: a 1e-6 update of a bfloat16 weight of 0.02 rounds away.
    dtype = getattr(torch, args.dtype)
    return torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32)


def logps_without_grad(model, input_ids, attention_mask, T, parts, args, share_prompt):
    """Reference or old log-probs [rows, T]: no graph, one micro-batch at a time like every other pass."""
    logps = []
    with torch.no_grad(), autocast(args, input_ids.device):
        for part in parts:
            logps.append(completion_logps(model, input_ids[part], attention_mask[part], T,
                                          temperature=args.temperature, chunk_size=args.logp_chunk_size,
                                          with_entropy=False, share_prompt=share_prompt)[0])
    return torch.cat(logps)


def completion_logps(model, input_ids, attention_mask, num_completion_tokens, *, temperature=1.0, chunk_size=0,
                     entropy_grad=False, with_entropy=True, share_prompt=False):
    """Log-probs and entropy of each row's last T tokens, [rows, T] each, and the MoE router loss or None.

    The decoder's last hidden states go through lm_head chunk_size tokens at a time, so the [rows, T, V] logits never
    exist at once: a chunk's do, beside the model's own for each row's last position (a few chunks with grad). At a
    real vocabulary a chunk is a small part of the batch (110 tokens at Qwen's 151,936), at the toy's all of it.
    With grad, call it with the DDP wrapper: the wrapper's forward is what syncs the gradients.
    share_prompt: each distinct prompt of the rows (a group's, or the part of a group the micro-batch holds) is
    forwarded once, and its rows forward on its KV cache (forward_on_prompt_cache).
    """
    T = num_completion_tokens
    # Positions count real tokens only, as generate() counted them under left padding.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    grad = torch.is_grad_enabled()
    moe = grad and is_moe(model)
    # Without grad the bare module is enough, and it skips DDP's buffer broadcast.
    net = model if grad else unwrap(model)
    bare = unwrap(model)
    # A prompt of one token has nothing to cache.
    if share_prompt and input_ids.shape[1] - T > 1:
        hidden, aux = forward_on_prompt_cache(net, input_ids, attention_mask, position_ids, T, moe)
    else:
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        if moe:
            inputs["output_router_logits"] = True
        # The decoder's last hidden state [rows, P + T, H], caught on its way to the model's own lm_head.
        decoded, out = forward_last_hidden(net, **inputs)
        aux = out.aux_loss if moe else None
        # The hidden state before token t predicts token t.
        hidden = decoded.last_hidden_state[:, -T - 1:-1, :]
    targets = input_ids[:, -T:]
    rows = targets.shape[0]
    vocab = bare.get_output_embeddings().weight.shape[0]
    # By default, as many tokens as fit 64 MiB of float32 logits.
    chunk_size = chunk_size or auto_chunk_tokens(vocab)
    logps = []
    entropy = []
    for h, y in zip(hidden.reshape(rows * T, -1).split(chunk_size), targets.reshape(rows * T).split(chunk_size)):
        if grad:
            # Keep only the chunk's inputs; its logits are recomputed in backward.
            lp, ent = recompute_in_backward(_chunk_logps_entropy, bare, h, y, temperature, entropy_grad,
                                            with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_logps_entropy(bare, h, y, temperature, False, with_entropy)
        logps.append(lp)
        entropy.append(ent)
    return torch.cat(logps).view(rows, T), torch.cat(entropy).view(rows, T), aux


def _chunk_logps_entropy(model, hidden, targets, temperature, entropy_grad, with_entropy=True):
    """One chunk: hidden [c, H] -> logits [c, V], which exist only here -> log-probs [c] and entropy [c]."""
    # z = lm_head(h), then the scale, divisor or softcap the model's config applies after it (lm_logits).
    logits = lm_logits(model, hidden).float()
    if temperature != 1.0:
        # In place, so no second [c, V] tensor exists.
        logits.div_(temperature)
    logps = selective_log_softmax(logits, targets)
    if not with_entropy:
        return logps, torch.zeros_like(logps.detach())
    # Only logged, the entropy gets no graph at all. A bonus needs its gradient, recomputed in backward.
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    return logps, entropy


def selective_log_softmax(logits, index):
    # log p(o) = z[o] - logsumexp(z), without a [.., V] log-softmax tensor.
    z = logits.reshape(-1, logits.shape[-1]).float()
    logps = z.gather(-1, index.reshape(-1, 1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return logps.view(index.shape)


def entropy_from_logits(logits):
    # H = logsumexp(z) - sum_v softmax(z)_v * z_v
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)


# ---------------------------------------------------------------------------------------------------------------
# Stages 8-9. The objective and its normalization.
# ---------------------------------------------------------------------------------------------------------------
def loss_divisor(loss_type, num_rows, micro_rows, N, world, max_gen_len):
    """D, the divisor of a micro-batch's loss. num_rows: this rank's B*G; micro_rows: the micro-batch's rows;
    N: masked tokens over all ranks."""
    if loss_type == "grpo":
        # D = B*G, after each row is averaged over its own tokens: every sequence weighs the same.
        return num_rows
    if loss_type == "bnpo":
        # D = B*G / micro_rows, after the micro-batch is averaged over its tokens: it weighs its share of the rows.
        # With S equal micro-batches, D = S.
        return num_rows / micro_rows
    if loss_type == "dr_grpo":
        # D = B*G * L_max, a constant: no bias toward short or long completions.
        return num_rows * max_gen_len
    if loss_type in ("dapo", "cispo"):
        # D = N / world: DDP averages the ranks' gradients, so summed over ranks this is sum L m / N.
        return max(float(N) / world, 1.0)
    raise ValueError(f"unknown loss_type {loss_type!r}; choose from {LOSS_TYPES}")


def policy_objective(logps, old_logps, advantages, mask, *, loss_type, epsilon, epsilon_high, divisor,
                     ref_logps=None, beta=0.0, importance_sampling_level="token"):
    """The per-token objective of any --loss_type (the clipped one, or cispo's), plus beta times the KL,
    normalized: (loss, stats). logps, old_logps, ref_logps, mask: [rows, T]; advantages: [rows]. old_logps and
    ref_logps carry no graph."""
    assert not old_logps.requires_grad, "old_logps must be detached: exp(x - x) has zero gradient"
    mask = mask.to(logps.dtype)
    A = advantages.to(logps.dtype).unsqueeze(1)
    # rho = exp(logp - old), the ratio (r is the reward). It is 1 on-policy, and its gradient is rho * dlogp because
    # old has no graph.
    log_ratio = logps - old_logps
    if importance_sampling_level == "sequence":
        assert loss_type != "cispo", "GSPO's sequence ratio is for the clipped objective"
        # GSPO: log s_i = sum_t m (logp - old) / max(sum_t m, 1), the same s_i on every token of o_i.
        seq_log_ratio = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        log_ratio = seq_log_ratio.expand_as(logps)
    ratio = torch.exp(log_ratio)
    if loss_type == "cispo":
        # L = -sg(min(rho, eps_h)) * A * logp: a capped weight without gradient on a REINFORCE term.
        per_token = -torch.clamp(ratio, max=epsilon_high).detach() * A * logps
        clipped = (ratio > epsilon_high) & (A > 0)
    else:
        # L = -min(rho * A, clip(rho, 1 - eps, 1 + eps_h) * A)
        per_token = -torch.min(ratio * A, torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * A)
        clipped = ((ratio < 1 - epsilon) & (A < 0)) | ((ratio > 1 + epsilon_high) & (A > 0))
    policy_loss = normalize(per_token.detach(), mask, loss_type, divisor)
    kl_sum = torch.zeros((), device=logps.device)
    if beta > 0:
        # k3: KL = exp(ref - logp) - (ref - logp) - 1, added as + beta * KL
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
        kl_sum = (kl * mask).sum().detach()
    loss = normalize(per_token, mask, loss_type, divisor)
    clipped_tokens = (clipped.to(mask.dtype) * mask).sum()
    return loss, {"policy_loss": policy_loss, "kl_sum": kl_sum, "clipped_tokens": clipped_tokens}


def normalize(per_token, mask, loss_type, divisor):
    # sum L m / D. grpo first averages each row over its tokens, bnpo the micro-batch over its tokens.
    total = per_token * mask
    if loss_type == "grpo":
        return (total.sum(1) / mask.sum(1).clamp(min=1)).sum() / divisor
    if loss_type == "bnpo":
        return total.sum() / mask.sum().clamp(min=1) / divisor
    return total.sum() / divisor


# ---------------------------------------------------------------------------------------------------------------
# Stages 11 and 13. The entropy coefficient and the update.
# ---------------------------------------------------------------------------------------------------------------
def world_token_mean(local_sum, local_count, device="cpu"):
    # H_w = all_reduce(sum H m) / max(all_reduce(sum m), 1)
    # It is a world sum over a world count, never a mean of per-rank means.
    # A step in which every token is masked measures 0, as in TRL.
    total, count = world_sum(local_sum, local_count, device=device)
    return total / max(count, 1.0)


def update_entropy_coef(c, world_entropy, *, target, delta, coef_min, coef_max):
    # c <- min(c + delta, c_max) if H_w < target else max(c - delta, c_min).
    # The next step applies alpha = c if H_w < target, else 0. Returns (c, alpha).
    if world_entropy < target:
        c = min(c + delta, coef_max)
        return c, c
    return max(c - delta, coef_min), 0.0


def lr_factor(step, args):
    # lr * f(s) after s steps that applied an update: f = (s + 1) / (w + 1) during the w warmup steps,
    # then 1 (constant) or 0.5 * (1 + cos(pi * (s - w) / (max_steps - w))) (cosine).
    if step < args.warmup_steps:
        return (step + 1) / (args.warmup_steps + 1)
    if args.lr_scheduler == "constant":
        return 1.0
    progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def build_optimizer(policy, args):
    """AdamW on the policy's float32 weights, and the schedule that sets its learning rate by lr_factor."""
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, args))
    return optimizer, scheduler


def clip_grad_norm(model, max_norm):
    """The global grad norm, with the gradients scaled down to max_norm if above it (0: no clipping)."""
    if max_norm <= 0:
        max_norm = math.inf
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


# ===============================================================================================================
# Above: the config, one step, and every formula of the update. Below: the plumbing the step calls, by names that say
# what it does. A formula also rests on some of it: lm_logits (a model's logit scale or softcap), eos_token_ids (the
# ids that end a completion, so the mask m), world_mean_and_std (the std of --scale_rewards batch over all ranks),
# frozen_copy (the reference's dtype rule), forward_on_prompt_cache (which positions predict, with a shared prompt),
# router_loss (an MoE's load balance then) and the built-in tasks' reward functions. Then come the loop, the tasks,
# models, processes, flags, checkpoints and logging.
# ===============================================================================================================


# ---------------------------------------------------------------------------------------------------------------
# Plumbing of stages 1-3: prompts, the rollout and the reward calls.
# ---------------------------------------------------------------------------------------------------------------
GSM8K_SYSTEM_PROMPT = ("Solve the math problem. Reason step by step, then write the final answer alone on the last "
                       "line as '#### <number>'.")


def render_prompt(tokenizer, row):
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if "prompt" not in row:
        question = row["question"]
        if not has_template:
            return f"{GSM8K_SYSTEM_PROMPT}\n\nQuestion: {question}\nAnswer:"
        messages = [{"role": "system", "content": GSM8K_SYSTEM_PROMPT}, {"role": "user", "content": question}]
    else:
        messages = row["prompt"]
        if isinstance(messages, str):
            return messages
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                     for m in messages):
            raise TrainerError(f"--dataset: a chat prompt must be a list of messages with 'role' and 'content', "
                               f"got {messages!r:.80}")
        if not has_template:
            raise TrainerError("--dataset: the prompts are chat messages, but the tokenizer has no chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def tokenize_prompts(tokenizer, prompts, max_prompt_len, device, repeat=1):
    """Left-padded ids and mask [B * repeat, P], and how many prompts were cut. A cut drops the start, since the end
    holds the question, but keeps the BOS the tokenizer puts first, since the model never saw text without one."""
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("a").input_ids[:1] == [bos]
    ids = tokenizer(list(prompts), add_special_tokens=False).input_ids
    prompts_cut = 0
    kept = []
    for x in ids:
        if adds_bos and x[:1] != [bos]:
            x = [bos] + x
        if len(x) > max_prompt_len:
            prompts_cut += 1
            # With a budget of one token, the last one is worth more than the BOS.
            if x[:1] == [bos] and max_prompt_len > 1:
                x = x[:1] + x[len(x) - max_prompt_len + 1:]
            else:
                x = x[len(x) - max_prompt_len:]
        kept.append(x)
    width = max(len(x) for x in kept)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in kept], device=device)
    attention_mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in kept], device=device)
    return input_ids.repeat_interleave(repeat, 0), attention_mask.repeat_interleave(repeat, 0), prompts_cut


@torch.no_grad()
def rollout(policy, input_ids, attention_mask, tokenizer, *, max_gen_len, do_sample=True, temperature=1.0,
            static_cache=False, group_size=1):
    """Completions [rows, T] of the left-padded prompts, their mask and which ones never ended. With group_size > 1
    the rows come in groups of that many equal prompts, and each group's prompt is forwarded once."""
    from transformers import GenerationConfig
    eos = eos_token_ids(policy, tokenizer)
    sampling = dict(temperature=temperature, top_k=0, top_p=1.0) if do_sample else {}
    config = GenerationConfig(max_new_tokens=max_gen_len, do_sample=do_sample, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=eos, bos_token_id=tokenizer.bos_token_id,
                              cache_implementation="static" if static_cache else None, **sampling)
    if static_cache:
        # The compiled decode step is specialized to the cache's shape: widths in steps of 64 compile rarely.
        pad = -input_ids.shape[1] % 64
        input_ids = torch.nn.functional.pad(input_ids, (pad, 0), value=tokenizer.pad_token_id)
        attention_mask = torch.nn.functional.pad(attention_mask, (pad, 0), value=0)
    was_training = policy.training
    checkpoint_config = policy.generation_config
    policy.eval()
    # generate() fills the fields left unset from the model's generation_config, and a checkpoint's (a repetition
    # penalty, top-k 50) would sample from a distribution the ratio never scores, so that one is set aside.
    policy.generation_config = GenerationConfig()
    try:
        cache = None
        # The static cache's batch is fixed when it is made, so the compiled decode on CUDA prefills every row.
        if group_size > 1 and not static_cache and input_ids.shape[1] > 1:
            # generate() forwards what the cache lacks: each row's last prompt token, then the new ones.
            cache = prompt_cache(policy, input_ids[::group_size, :-1], attention_mask[::group_size, :-1])[0]
            cache.batch_repeat_interleave(group_size)
        out = policy.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                              cache=cache)
        # generate() caches every token but the last it sampled. A model that made a cache of its own sampled blind.
        if cache is not None and cache.get_seq_length() != out.shape[1] - 1:
            raise TrainerError("--share_prompt 1: the model did not read its prompt's KV cache; run with "
                               "--share_prompt 0")
    finally:
        policy.generation_config = checkpoint_config
        policy.train(was_training)
    completion_ids = out[:, input_ids.shape[1]:]
    mask, truncated = completion_mask(completion_ids, eos)
    return completion_ids, mask, truncated


def prompt_cache(model, input_ids, attention_mask, **kwargs):
    """A KV cache of the left-padded rows, and the decoder's output: the bare decoder, since no logits are needed,
    and with positions counted as completion_logps and generate() count them."""
    from transformers import DynamicCache
    cache = DynamicCache()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = unwrap(model).get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                      cache=cache, use_cache=True, **kwargs)
    return cache, out


def eos_token_ids(model, tokenizer):
    """Every id that ends a completion: the tokenizer's EOS and the generation config's (Llama-3 has three)."""
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if not isinstance(declared, (list, tuple)):
        declared = [declared]
    return sorted({i for i in [tokenizer.eos_token_id, *declared] if i is not None})


def completion_token_ids(completion_ids, mask):
    return [ids[m.bool()].tolist() for ids, m in zip(completion_ids, mask)]


def unwrap(model):
    return model.module if isinstance(model, DDP) else model


class TrainerError(Exception):
    """A problem with the user's input: reported as one line, never a traceback."""


def one_line(e):
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def reward_prompt(row, text):
    """The dataset's prompt, copied so that a reward editing it never changes the row; else the rendered text."""
    if "prompt" not in row:
        return text
    return copy.deepcopy(row["prompt"])


def score_completions(reward_fns, prompts, completions, completion_ids_list, rows):
    table = torch.full((len(completions), len(reward_fns)), math.nan, dtype=torch.float64)
    for k, fn in enumerate(reward_fns):
        values = call_reward(fn, prompts, completions, completion_ids_list, rows)
        for i, value in enumerate(values):
            if value is None:
                continue
            number = float(value)
            if not math.isfinite(number):
                raise TrainerError(f"reward {fn.__name__} returned {number} for sample {i}, not a finite number")
            table[i, k] = number
    unscored = table.isnan().all(1).tolist()
    if any(unscored):
        i = unscored.index(True)
        raise TrainerError(f"every reward function returned None for sample {i} (completion "
                           f"{completions[i][:60]!r}): at least one must score it")
    return table


def call_reward(fn, prompts, completions, completion_ids_list, rows):
    if not isinstance(prompts[0], str):
        completions = [[{"role": "assistant", "content": c}] for c in completions]
    passed_already = ("prompt", "completion", "completion_ids")
    # Each value is a copy, so a reward that edits a column never changes the training rows.
    columns = {k: [copy.deepcopy(row[k]) for row in rows] for k in rows[0] if k not in passed_already}
    try:
        values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids_list, **columns)
    except Exception as e:
        e.add_note(f"in reward function {fn.__name__}, called by train_grpo.py on {len(rows)} samples")
        raise
    if hasattr(values, "tolist"):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != len(rows):
        raise TrainerError(f"reward {fn.__name__} returned {values!r:.40}, not a list of {len(rows)} values")
    return values


def world_sum(*values, device="cpu"):
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def world_std(values, device="cpu"):
    return world_mean_and_std(values, device)[1]


def world_mean_and_std(values, device="cpu"):
    # std = sqrt((sum x^2 - (sum x)^2 / n) / (n - 1)). As TRL's nanmean and nanstd, no value has no mean, one no std.
    s, s2, n = world_sum(values.double().sum(), (values.double() ** 2).sum(), values.numel(), device=device)
    mean = s / n if n > 0 else math.nan
    std = math.sqrt(max(s2 - s * s / n, 0.0) / (n - 1)) if n > 1 else math.nan
    return mean, std


# ---------------------------------------------------------------------------------------------------------------
# Plumbing of stage 7: the decoder's last hidden state, and logits as the model's own forward makes them.
# ---------------------------------------------------------------------------------------------------------------
def is_moe(model):
    return hasattr(unwrap(model).config, "router_aux_loss_coef")


def forward_last_hidden(model, decoder_kwargs=None, **inputs):
    """model(**inputs) and the decoder's output, hooked for its last hidden state: output_hidden_states would keep
    every layer's. decoder_kwargs reach the decoder alone."""
    caught = []
    decoder = unwrap(model).get_decoder()
    hooks = [decoder.register_forward_hook(lambda module, args, out: caught.append(out))]
    if decoder_kwargs:
        hooks.append(decoder.register_forward_pre_hook(
            lambda module, args, kwargs: (args, {**kwargs, **decoder_kwargs}), with_kwargs=True))
    try:
        out = model(**inputs, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    return caught[0], out


def forward_on_prompt_cache(model, input_ids, attention_mask, position_ids, T, moe):
    """The hidden states that predict the last T tokens [rows, T, H], and an MoE's router loss or None, with each
    distinct prompt forwarded once. Its first P - 1 tokens fill a KV cache through the bare decoder; the rows then
    forward their last prompt token and T - 1 completion tokens on it, through `model` (the DDP wrapper, with grad),
    whose outputs reach the cache's graph. Those T positions are the ones that predict."""
    P = input_ids.shape[1] - T
    # The distinct prompts, ids and padding alike, and which of them each row holds.
    prompts, prompt_of_row = torch.unique(torch.cat([input_ids[:, :P], attention_mask[:, :P].to(input_ids.dtype)], 1),
                                          dim=0, return_inverse=True)
    prefix_ids = prompts[:, :P - 1]
    prefix_mask = prompts[:, P:2 * P - 1]
    router = {"output_router_logits": True} if moe else {}
    cache, prompt_out = prompt_cache(model, prefix_ids, prefix_mask, **router)
    # Each row reads its prompt's cache. Under grad the copies' gradients add up in the prompt's.
    cache.batch_select_indices(prompt_of_row)
    # The decoder hands back its routers' logits, and the model around it computes no router loss of its own:
    # transformers' would count the cached tokens in its mask but not in its logits.
    decoded, _ = forward_last_hidden(model, router, input_ids=input_ids[:, P - 1:-1],
                                     attention_mask=attention_mask[:, :-1], position_ids=position_ids[:, P - 1:-1],
                                     cache=cache, use_cache=True)
    if cache.get_seq_length() != input_ids.shape[1] - 1:
        raise TrainerError("--share_prompt 1: the model did not read its prompt's KV cache; run with --share_prompt 0")
    if not moe:
        return decoded.last_hidden_state, None
    # The router loss sees each prompt's first P - 1 tokens once, and every row's T tokens that predict one.
    logits = [torch.cat(pair) for pair in zip(prompt_out.router_logits, decoded.router_logits)]
    tokens = torch.cat([prefix_mask.reshape(-1), attention_mask[:, P - 1:-1].reshape(-1)])
    bare = unwrap(model)
    return decoded.last_hidden_state, router_loss(logits, tokens, bare.num_experts, bare.num_experts_per_tok)


def router_loss(router_logits, token_mask, num_experts, top_k):
    # Switch Transformer's load balance, as transformers computes it: E * sum_e f_e * p_e over every layer's real
    # tokens, f_e the fraction of tokens whose top k picks expert e (they sum to k), p_e e's mean router probability.
    probs = torch.cat([logits.float().softmax(-1) for logits in router_logits])
    m = token_mask.float().repeat(len(router_logits)).unsqueeze(1)
    picks = torch.nn.functional.one_hot(probs.topk(top_k, dim=-1).indices, num_experts).sum(1)
    f = (picks * m).sum(0) / m.sum()
    p = (probs * m).sum(0) / m.sum()
    return num_experts * (f * p).sum()


def lm_logits(model, hidden):
    # z = lm_head(h), then what the model's own forward applies after it. check_output_head refuses the rest.
    config = model.config.get_text_config()
    z = model.get_output_embeddings()(hidden)
    if getattr(config, "logit_scale", None) is not None:
        z = z * config.logit_scale
    if getattr(config, "logits_scaling", None) is not None:
        z = z / config.logits_scaling
    if getattr(config, "final_logit_softcapping", None):
        z = torch.tanh(z / config.final_logit_softcapping) * config.final_logit_softcapping
    return z


# At a real vocabulary [rows, T, V] logits would be a step's largest tensor, so a chunk of them is bounded in bytes.
LOGITS_BUDGET_MIB = 64


def auto_chunk_tokens(vocab_size, budget_mib=LOGITS_BUDGET_MIB):
    return max(1, budget_mib * 2**20 // (vocab_size * 4))


# ---------------------------------------------------------------------------------------------------------------
# Plumbing of stage 14: the step's metrics over all ranks, its time and its memory.
# ---------------------------------------------------------------------------------------------------------------
def step_metrics(args, run, batch, state, update_stats, step_time):
    """TRL's names. Every rank has B*G rows, so the world's mean is the sum of the rank means over the world size.
    The timings and the memory are this rank's; tokens_per_s is the world's completion tokens over this rank's time."""
    device = batch.input_ids.device
    N = update_stats["N"]
    grouped = batch.rewards.view(-1, args.num_generations)
    rank_means = {"reward": batch.rewards.mean(), "completion_len": batch.completion_len.mean(),
                  "truncated_frac": batch.truncated.float().mean(),
                  "frac_reward_zero_std": (grouped.amax(1) == grouped.amin(1)).float().mean(),
                  "loss": update_stats["loss"], "policy_loss": update_stats["policy_loss"]}
    if is_moe(run.model):
        rank_means["aux_loss"] = update_stats["aux"]
    world_totals = world_sum(*rank_means.values(), device=device)
    record = {}
    for name, total in zip(rank_means, world_totals):
        record[name] = total / run.world
    record.update(reward_metrics("rewards", run.reward_fns, values_per_func(batch, run), device))
    kl_sum, clipped, prompts_cut, tokens = world_sum(update_stats["kl"], update_stats["clipped"], batch.prompts_cut,
                                             batch.completion_len.sum(), device=device)
    record.update({"kl": kl_sum / max(N, 1.0), "clip_ratio": clipped / max(N, 1.0),
                   "reward_std": world_std(batch.rewards, device), "advantage_std": world_std(batch.advantages, device),
                   "entropy": state.world_entropy, "entropy_coef": state.entropy_coef,
                   "entropy_coef_applied": update_stats["entropy_coef_applied"], "grad_norm": update_stats["grad_norm"],
                   "learning_rate": update_stats["learning_rate"], "skipped_updates": state.skipped_updates,
                   "prompts_cut": int(prompts_cut)})
    if run.scaler.is_enabled():
        record["loss_scale"] = run.scaler.get_scale()
    record.update({"step_time": step_time, "generate_time": batch.generate_time, "tokens_per_s": tokens / step_time,
                   "peak_mem_gib": peak_memory_gib(run.device)})
    return record


def values_per_func(batch, run):
    """A fork's Batch may bring no rewards_per_func: then all NaN, so every rank still runs the same reductions."""
    if batch.rewards_per_func is None:
        return torch.full((len(batch.rewards), len(run.reward_fns)), math.nan, dtype=torch.float64)
    return batch.rewards_per_func


def reward_metrics(prefix, reward_fns, rewards_per_func, device):
    record = {}
    for k, fn in enumerate(reward_fns):
        values = rewards_per_func[:, k]
        mean, std = world_mean_and_std(values[~values.isnan()], device)
        record[f"{prefix}/{fn.__name__}/mean"] = mean
        record[f"{prefix}/{fn.__name__}/std"] = std
    return record


def reset_peak_memory(device):
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device):
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    # Linux reports ru_maxrss in KiB, macOS in bytes.
    unit = 1 if sys.platform == "darwin" else 2**10
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit / 2**30


# ---------------------------------------------------------------------------------------------------------------
# The loop.
# ---------------------------------------------------------------------------------------------------------------
def train(args, rank, world, device, collect=None):
    started = time.time()
    ckpt = checkpoint_to_resume(args)
    continues_here = args.resume == "auto" or (
        ckpt is not None and os.path.dirname(os.path.abspath(ckpt)) == os.path.abspath(args.save_dir))
    holds_a_run = find_checkpoint(args.save_dir) or os.path.isfile(os.path.join(args.save_dir, "args.json"))
    if holds_a_run and not continues_here:
        # Another run there would replace this one's logs, and a later --resume auto would pick the wrong one.
        raise TrainerError(f"--save_dir {args.save_dir} holds an earlier run: continue it with --resume auto, or "
                           f"give another --save_dir")
    # Every rank has looked before rank 0 writes args.json there.
    barrier()
    random.seed(args.seed)
    np.random.seed(args.seed)
    # The same seed on every rank gives the same initial weights (DDP also broadcasts rank 0's).
    torch.manual_seed(args.seed)
    # The task first, so that a problem with the dataset stops the run before a model loads.
    train_rows, eval_rows, reward_fns, weights, eval_key = load_task(args, world)
    policy, tokenizer = load_model_and_tokenizer(args, device)
    if rank == 0:
        print(f"{len(train_rows)} training prompts; {len(eval_rows)} held-out prompts, never trained on")
        print(f"flags that differ from the defaults: {changed_flags(args) or 'none'}")
        os.makedirs(args.save_dir, exist_ok=True)
        write_args(args, args.save_dir, world)
    prompt_order = DistributedSampler(range(len(train_rows)), num_replicas=world, rank=rank, shuffle=True,
                                      seed=args.seed, drop_last=True)
    model = wrap_ddp(policy, device) if world > 1 else policy
    if not args.model_name_or_path and args.sft_warmup_steps > 0 and (ckpt is None or args.beta > 0):
        # A resume redoes the deterministic warm-up only for the reference, the policy as the warm-up left it.
        sft_warmup(model, tokenizer, train_rows, args, device, rank, world)
    ref_model = frozen_copy(policy, getattr(torch, args.dtype)) if args.beta > 0 else None
    optimizer, scheduler = build_optimizer(policy, args)
    run = Run(model, ref_model, optimizer, scheduler, loss_scaler(args.dtype, device), tokenizer, reward_fns, weights,
              world, device)
    last_eval = ""
    if ckpt:
        state = resume(args, ckpt, run, rank)
        report, close_report = open_report(args, rank, first_step=state.step + 1)
    else:
        state = TrainState.initial(args)
        report, close_report = open_report(args, rank, first_step=0)
        # Each rank samples its own completions, and the supervised warm-up no longer shifts the random streams.
        torch.manual_seed(args.seed + 1 + rank)
        random.seed(args.seed + 1 + rank)
        if rank == 0:
            for name in LOGS:
                open(os.path.join(args.save_dir, name), "w").close()
        if args.eval_interval > 0:
            record, samples = evaluate(args, run, eval_rows, eval_key, rank, step=0)
            log_step(args, {"step": 0, **record}, samples, rank, report)
            last_eval = f"{record[eval_key]:.3f}"
            if rank == 0:
                print(f"{eval_key} before GRPO: {last_eval}")
    model.train()
    bar = tqdm(range(state.step + 1, args.max_steps + 1), initial=state.step, total=args.max_steps,
               disable=rank != 0, desc="grpo")
    warned_cut = False
    for step in bar:
        state.step = step
        prompt_rows = next_prompts(prompt_order, train_rows, state, args.batch_size)
        metrics, batch = grpo_step(args, run, prompt_rows, state, collect)
        record = {"step": step, **metrics}
        samples = []
        if args.log_completions and rank == 0:
            samples = batch_samples(step, batch, run)
        if args.eval_interval > 0 and (step % args.eval_interval == 0 or step == args.max_steps):
            if rank == 0:
                # The training rows decoded for completions.jsonl, if they were.
                print_group(samples or batch_samples(step, batch, run), args.num_generations)
            eval_record, eval_samples = evaluate(args, run, eval_rows, eval_key, rank, step)
            record.update(eval_record)
            samples += eval_samples
            last_eval = f"{record[eval_key]:.3f}"
        log_step(args, record, samples, rank, report)
        bar.set_postfix(reward=f"{record['reward']:.3f}", eval=last_eval)
        if record["prompts_cut"] and not warned_cut and rank == 0:
            print(f"warning: prompts longer than --max_prompt_len {args.max_prompt_len} lose their start")
            warned_cut = True
        stopping = args.stop_after and step >= args.stop_after
        periodic = args.save_interval and step % args.save_interval == 0
        if periodic or stopping or step == args.max_steps:
            ckpt = save(args, run, state, rank)
        if stopping:
            break
    where = ckpt
    if state.step == args.max_steps:
        where = os.path.join(args.save_dir, "final")
    if rank == 0 and state.step == args.max_steps:
        shutil.rmtree(where, ignore_errors=True)
        shutil.copytree(ckpt, where, ignore=shutil.ignore_patterns("*.pt"))
    if rank == 0:
        print(summary(args, state, eval_key, started) + f"; model: {where}")
    if close_report is not None:
        close_report()
    barrier()
    return {"model": policy, "step": state.step, "entropy_coef": state.entropy_coef,
            "entropy_coef_applied": state.entropy_coef_applied, "world_entropy": state.world_entropy}


def next_prompts(prompt_order, train_rows, state, batch_size):
    if state.sampler_pos + batch_size > len(prompt_order):
        state.sampler_epoch += 1
        state.sampler_pos = 0
    # The sampler draws its permutation from seed + epoch alone, so it is the same at every step of an epoch.
    prompt_order.set_epoch(state.sampler_epoch)
    order = list(prompt_order)[state.sampler_pos:state.sampler_pos + batch_size]
    state.sampler_pos += batch_size
    return [train_rows[i] for i in order]


def loss_scaler(dtype, device):
    # float16 needs dynamic loss scaling. bfloat16 has float32's exponent range and needs none.
    return torch.amp.GradScaler(torch.device(device).type, enabled=dtype == "float16")


def frozen_copy(policy, dtype):
    """Autocast feeds the policy's Linear layers a --dtype copy of their weights, so the reference stores just that
    copy, and the rest (embeddings, a head tied to them, norms) as the policy has it: KL = 0 at equal weights."""
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    embedding = ref.get_input_embeddings().weight
    for module in ref.modules():
        if isinstance(module, torch.nn.Linear) and module.weight is not embedding:
            module.to(dtype)
    return ref


def sft_warmup(model, tokenizer, train_rows, args, device, rank, world):
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_learning_rate)
    scaler = loss_scaler(args.dtype, device)
    # Its own generator, apart from the one that samples the rollouts, so the warm-up never shifts their streams.
    rng = random.Random(args.seed + 7)
    for _ in tqdm(range(args.sft_warmup_steps), desc="sft warmup", disable=rank != 0, leave=False):
        picks = [rng.randrange(len(train_rows)) for _ in range(args.sft_batch_size)]
        rows = [train_rows[i] for i in picks[rank::world]]
        ids, prompt_mask, _ = tokenize_prompts(tokenizer, [r["prompt"] for r in rows], args.max_prompt_len, device)
        answers = [tokenizer(r["answer"], add_special_tokens=False).input_ids for r in rows]
        target = torch.tensor([a + [tokenizer.eos_token_id] for a in answers], device=device)
        with autocast(args, device):
            logps, _, aux = completion_logps(model, torch.cat([ids, target], 1),
                                             torch.cat([prompt_mask, torch.ones_like(target)], 1), target.shape[1],
                                             chunk_size=args.logp_chunk_size, with_entropy=False)
        # The whole batch's token mean however the ranks split it: DDP averages, and the answers are equally long.
        loss = -logps.sum() * world / (args.sft_batch_size * target.shape[1])
        if aux is not None:
            loss = loss + unwrap(model).config.router_aux_loss_coef * aux
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = clip_grad_norm(unwrap(model), 1.0)
        if torch.isfinite(grad_norm):
            scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def evaluate(args, run, eval_rows, eval_key, rank, step, per_call=0):
    per_call = per_call or args.batch_size * args.num_generations
    policy = unwrap(run.model)
    tokenizer = run.tokenizer
    mine = eval_rows[rank::run.world]
    total = 0.0
    tables = [torch.zeros((0, len(run.reward_fns)), dtype=torch.float64)]
    samples = []
    for start in range(0, len(mine), per_call):
        rows = mine[start:start + per_call]
        texts = [render_prompt(tokenizer, row) for row in rows]
        ids, prompt_mask, _ = tokenize_prompts(tokenizer, texts, args.max_prompt_len, run.device)
        with autocast(args, run.device):
            completion_ids, mask, _ = rollout(policy, ids, prompt_mask, tokenizer, max_gen_len=args.max_gen_len,
                                              do_sample=False, static_cache=torch.device(run.device).type == "cuda")
        token_ids = completion_token_ids(completion_ids, mask)
        completions = tokenizer.batch_decode(token_ids, skip_special_tokens=True)
        prompts = [reward_prompt(row, text) for row, text in zip(rows, texts)]
        table = score_completions(run.reward_fns, prompts, completions, token_ids, rows)
        rewards = compute_rewards(table, run.weights)
        scores = rewards
        if eval_key == "eval_accuracy":
            # The task's first reward checks correctness, and gives exactly 1.0 to a right answer.
            scores = (table[:, 0] == 1.0).float()
        total += sum(scores.tolist())
        tables.append(table)
        if rank == 0:
            samples += completion_samples(step, "eval", run, ids, prompt_mask, completions, table, rewards)
    total, count = world_sum(total, len(mine), device=run.device)
    record = {eval_key: total / max(count, 1)}
    record.update(reward_metrics("eval_rewards", run.reward_fns, torch.cat(tables), run.device))
    return record, samples


# ---------------------------------------------------------------------------------------------------------------
# Tasks, datasets and their rewards.
# ---------------------------------------------------------------------------------------------------------------
REVERSE_ALPHABET = "abcdefgh"
REVERSE_LEN = 5


def make_reverse_task(eval_size, seed=1234):
    # The built-in task: reverse a string of letters, "cabde=" -> "edbac". The held-out strings are never trained on.
    rng = random.Random(seed)
    strings = set()
    while len(strings) < 6000:
        strings.add("".join(rng.choice(REVERSE_ALPHABET) for _ in range(REVERSE_LEN)))
    rows = [{"prompt": s + "=", "answer": s[::-1]} for s in sorted(strings)]
    rng.shuffle(rows)
    return rows[eval_size:], rows[:eval_size]


def reverse_reward(completions, answer, **kwargs):
    # The characters in the right place over the longer length, so 1.0 only for an exact match.
    rewards = []
    for completion, target in zip(completions, answer):
        right = sum(a == b for a, b in zip(completion, target))
        rewards.append(right / max(len(completion), len(target), 1))
    return rewards


def make_compare_task(eval_size, seed=1234):
    # The larger of two 2-digit numbers, a task SmolLM2-135M-Instruct can learn; held out: trained in neither order.
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100) if a != b]
    random.Random(seed).shuffle(pairs)
    held_out = {frozenset(p) for p in pairs[:eval_size]}
    trained = [p for p in pairs[eval_size:] if frozenset(p) not in held_out]
    question = "Which number is larger, {} or {}? Answer with the number only."

    def rows(pairs):
        return [{"prompt": [{"role": "user", "content": question.format(a, b)}], "answer": max(a, b)}
                for a, b in pairs]
    return rows(trained), rows(pairs[:eval_size])


def text_of(completion):
    return completion if isinstance(completion, str) else completion[-1]["content"]


def compare_correct_reward(completions, answer, **kwargs):
    # 1.0 if the completion's first number is the larger one ("43 is larger than 15" counts as 43).
    rewards = []
    for completion, target in zip(completions, answer):
        first = re.search(r"-?\d+", text_of(completion))
        rewards.append(float(first is not None and int(first.group()) == int(target)))
    return rewards


def compare_format_reward(completions, **kwargs):
    # 1.0 if the completion is a number alone ("43" or "43."), as the prompt asks.
    return [float(re.fullmatch(r"\s*-?\d+\.?\s*", text_of(c)) is not None) for c in completions]


# lm-eval-harness's GSM8K strict match: the first '#### N' and the reference, normalized alike, must be equal.
GSM8K_ANSWER = r"#### (\-?[0-9\.\,]+)"
GSM8K_IGNORED = (",", r"\$", r"(?s).*#### ", r"\.$")


def gsm8k_normalized(text):
    for pattern in GSM8K_IGNORED:
        text = re.sub(pattern, "", text)
    return text.lower()


def gsm8k_correct_reward(completions, answer, **kwargs):
    # 1.0 if the first '#### N' matches the answer, both stripped of ',', '$', all before '#### ' and a final '.'.
    rewards = []
    for completion, target in zip(completions, answer):
        found = re.findall(GSM8K_ANSWER, text_of(completion))
        extracted = found[0].strip() if found else "[invalid]"
        rewards.append(float(gsm8k_normalized(extracted) == gsm8k_normalized(str(target))))
    return rewards


def gsm8k_format_reward(completions, **kwargs):
    # 1.0 if the completion ends with a '#### N' that the strict match reads.
    return [float(re.search(GSM8K_ANSWER + r"\s*$", text_of(c)) is not None) for c in completions]


def task_rewards(args):
    if not args.dataset:
        return [reverse_reward], [1.0]
    if args.dataset == "compare_numbers":
        return [compare_correct_reward, compare_format_reward], [1.0, 0.5]
    return [gsm8k_correct_reward, gsm8k_format_reward], [1.0, 0.1]


def load_reward_funcs(spec):
    fns = []
    for item in spec.split(","):
        path, _, name = item.strip().rpartition(":")
        if path:
            path = os.path.expanduser(path)
            if not os.path.isfile(path):
                raise TrainerError(f"--reward_funcs {item}: no such file {path}")
            try:
                module_spec = importlib.util.spec_from_file_location(f"reward_{len(fns)}", path)
                module = importlib.util.module_from_spec(module_spec)
                module_spec.loader.exec_module(module)
            except Exception as e:
                raise TrainerError(f"--reward_funcs {item}: importing {path} failed ({one_line(e)})") from None
            functions = vars(module)
        else:
            functions = {k: v for k, v in globals().items() if k.endswith("_reward")}
        fn = functions.get(name)
        if not callable(fn):
            where = path or "train_grpo.py's *_reward functions (file.py:name for your own)"
            raise TrainerError(f"--reward_funcs {item}: no function {name!r} in {where}")
        fns.append(fn)
    return fns


def load_task(args, world):
    reward_fns, weights = task_rewards(args)
    if args.reward_funcs:
        reward_fns = load_reward_funcs(args.reward_funcs)
        weights = [1.0] * len(reward_fns)
    names = [fn.__name__ for fn in reward_fns]
    # Each name keys its own metrics and its own column of the completions table.
    if len(set(names)) < len(names) or set(names) & {"step", "split", "prompt", "completion", "reward", "advantage"}:
        raise TrainerError(f"--reward_funcs: each function needs a name of its own, and none of step, split, prompt, "
                           f"completion, reward or advantage (got {', '.join(names)})")
    if args.reward_weights:
        try:
            weights = [float(w) for w in args.reward_weights.split(",")]
        except ValueError:
            weights = []
        if len(weights) != len(reward_fns) or not all(map(math.isfinite, weights)):
            raise TrainerError(f"--reward_weights {args.reward_weights!r}: give {len(reward_fns)} finite numbers, "
                               f"comma-separated, one for each reward function ({', '.join(names)})")
    if not args.dataset:
        train_rows, eval_rows = make_reverse_task(args.eval_size)
    elif args.dataset == "compare_numbers":
        train_rows, eval_rows = make_compare_task(args.eval_size)
    else:
        train_rows, eval_rows = load_rows(args)
        if args.dataset != "gsm8k" and not args.reward_funcs:
            raise TrainerError(f"--dataset {args.dataset} is not a built-in task: give its rewards with "
                               f"--reward_funcs (GSM8K's: --reward_funcs gsm8k_correct_reward,gsm8k_format_reward "
                               f"--reward_weights 1,0.1)")
    if len(train_rows) < args.batch_size * world:
        raise TrainerError(f"the training set has {len(train_rows)} prompts, fewer than batch_size * ranks = "
                           f"{args.batch_size * world}")
    if not eval_rows:
        args.eval_interval = 0
    eval_key = "eval_reward" if args.reward_funcs else "eval_accuracy"
    return train_rows, eval_rows, reward_fns, weights, eval_key


def load_rows(args):
    import datasets
    name = args.dataset
    path = os.path.expanduser(name)
    local = name.endswith((".jsonl", ".json", ".parquet")) or name.startswith((".", "/", "~"))
    source, config, files = name, None, None
    if name == "gsm8k":
        source, config = "openai/gsm8k", "main"
    elif os.path.isdir(path):
        # datasets would read every file in a folder, such as a run's own completions.jsonl, which has prompts.
        raise TrainerError(f"--dataset {name} is a folder: give a .jsonl, .json or .parquet file, or a hub name")
    elif local:
        if os.path.isfile(path) and os.path.getsize(path) == 0:
            raise TrainerError(f"--dataset {name}: the file is empty")
        source = "parquet" if path.endswith(".parquet") else "json"
        files = path
    try:
        splits = datasets.load_dataset(source, config, data_files=files)
    except Exception as e:
        raise TrainerError(f"--dataset {name}: could not load it ({one_line(e)})") from None
    train = splits["train"] if "train" in splits else splits[list(splits)[0]]
    columns = train.column_names
    needed = ["prompt"] if "prompt" in columns else ["question", "answer"]
    missing = [c for c in needed if c not in columns]
    if missing:
        raise TrainerError(f"--dataset {name}: no column {', '.join(missing)} (it has {', '.join(columns)}); "
                           "give a 'prompt' column, or 'question' and 'answer'")
    if len(train) == 0:
        raise TrainerError(f"--dataset {name}: the dataset is empty")
    rows = [dict(r) for r in train]
    if "train" in splits and "test" in splits:
        return rows, [dict(r) for r in splits["test"]][:args.eval_size]
    n_eval = min(args.eval_size, len(rows) // 10)
    return rows[n_eval:], rows[:n_eval]


# ---------------------------------------------------------------------------------------------------------------
# Models.
# ---------------------------------------------------------------------------------------------------------------
def build_char_tokenizer(chars):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + list(chars))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   padding_side="left")


def build_tiny_model(vocab_size, use_moe, tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    common = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=True,
                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    if use_moe:
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=64, num_experts=4,
                                                  num_experts_per_tok=2, decoder_sparse_step=1,
                                                  router_aux_loss_coef=0.01, **common))
    return Qwen3ForCausalLM(Qwen3Config(intermediate_size=128, **common))


def load_model_and_tokenizer(args, device):
    if not args.model_name_or_path:
        tokenizer = build_char_tokenizer(REVERSE_ALPHABET + "=")
        model = build_tiny_model(len(tokenizer), args.use_moe, tokenizer)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        name = args.model_name_or_path
        where = os.path.expanduser(name)
        kwargs = {"trust_remote_code": bool(args.trust_remote_code)}
        # from_pretrained would read a bad local path as a malformed hub name, so a local one is checked here.
        if name.endswith(".gguf"):
            if not os.path.isfile(where):
                raise TrainerError(f"--model_name_or_path {name}: no such file (a .gguf is read from a local file)")
            where, kwargs["gguf_file"] = os.path.split(os.path.abspath(where))
        elif name.startswith((".", "/", "~")) or os.path.exists(where):
            if not os.path.isfile(os.path.join(where, "config.json")):
                raise TrainerError(f"--model_name_or_path {name}: no such folder, or no config.json in it")
        try:
            tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kwargs)
        except Exception as e:
            raise TrainerError(f"--model_name_or_path {name}: {one_line(e)}") from None
        if "gguf_file" in kwargs:
            model = plain_model(model)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        if args.use_moe and not is_moe(model):
            raise TrainerError(f"--use_moe 1 but {name} is a dense {model.config.model_type}")
        from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin
        # A linear-attention layer caches one recurrent state of the whole prompt, which rows cannot select or extend.
        layers = DynamicCache(config=model.config).layers
        if args.share_prompt and any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in layers):
            raise TrainerError(f"--share_prompt 1: {name} caches recurrent states, not keys and values; run with "
                               f"--share_prompt 0")
    model.to(device=device, dtype=torch.float32)
    disable_dropout(model)
    check_output_head(model)
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    return model, tokenizer


def plain_model(model):
    """GGUF's dequantized float32 weights in a model without the quantizer's mark, which save_pretrained refuses."""
    from transformers import AutoModelForCausalLM
    del model.config.quantization_config
    plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    return plain


def disable_dropout(model):
    """With dropout, old (mu > 1) and reference (beta > 0) log-probs would differ at equal weights from logp."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)


@torch.no_grad()
def check_output_head(model):
    """The log-probs come from lm_logits(last hidden state): refuse a model whose forward makes logits otherwise."""
    vocab = model.get_output_embeddings().weight.shape[0]
    # Eight ids spread over the vocabulary by a large prime, so that the probe is not only the first few tokens.
    ids = (torch.arange(3, 11, device=model.device) * 7919 % vocab)[None]
    was_training = model.training
    decoded, out = forward_last_hidden(model.eval(), input_ids=ids, use_cache=False)
    model.train(was_training)
    ours = lm_logits(model, decoded.last_hidden_state[:, -1:]).float()
    theirs = out.logits.float()
    if not torch.allclose(ours, theirs, rtol=1e-2, atol=1e-2 * theirs.abs().max().item()):
        gap = (ours - theirs).abs().max().item()
        raise TrainerError(f"{type(model).__name__}'s forward post-processes its logits in a way "
                           f"train_grpo.lm_logits does not (max difference {gap:.3g}); add it there")


# ---------------------------------------------------------------------------------------------------------------
# Processes: torchrun and DDP.
# ---------------------------------------------------------------------------------------------------------------
def setup_distributed(args):
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        return 0, 1, torch.device(auto if args.device == "auto" else args.device)
    use_cuda = torch.cuda.is_available() and args.device != "cpu"
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def wrap_ddp(model, device):
    """The wrapper's hooks all-reduce the gradients of the loss's forward. Some experts may sit out a step."""
    per_expert_modules = any(isinstance(m, torch.nn.ModuleList) and name.endswith("experts")
                             for name, m in model.named_modules())
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
               find_unused_parameters=per_expert_modules)


def barrier():
    if dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------------------------------------------------------
# Flags. A problem with the input is one line `error: ...`, before any work.
# ---------------------------------------------------------------------------------------------------------------
# Saving every 50 steps caps what a kill costs. On a GPU, where memory is the limit, layers recompute in backward.
REAL_MODEL_DEFAULTS = dict(batch_size=8, micro_batch_size=8, max_prompt_len=512, max_gen_len=512,
                           learning_rate=1e-6, max_steps=500, eval_interval=50, save_interval=50, save_total_limit=2)
REAL_MODEL_GPU_DEFAULTS = dict(gradient_checkpointing=1)

TASK_DEFAULTS = {"compare_numbers": dict(batch_size=4, max_gen_len=8, max_prompt_len=128, learning_rate=2e-5,
                                         max_steps=40, eval_interval=10, eval_size=200)}

RESUME_MAY_CHANGE = ("max_steps", "save_interval", "save_total_limit", "eval_interval", "stop_after", "report_to",
                     "run_name", "save_dir", "resume", "gradient_checkpointing", "trust_remote_code",
                     "micro_batch_size", "logp_chunk_size", "log_completions", "num_completions_to_print")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="GRPO trainer in one file (README.md)",
        epilog="The defaults shown are the toy task's. A real model and a built-in task bring their own, --resume "
               "its run's. A run writes every flag to <save_dir>/args.json and prints those that differ from these.")
    # argparse's own error prints the usage first; one line is easier to read under torchrun.
    parser.error = lambda message: parser.exit(2, f"error: {message}\n")
    for f in dataclasses.fields(Args):
        parser.add_argument(f"--{f.name}", type=type(f.default), default=argparse.SUPPRESS,
                            choices=f.metadata["choices"], help=f"{f.metadata['help']} (default: {f.default!r})")
    # Only the flags typed are in the parse. The defaults of a real model, then of a task, fill in the rest.
    typed = vars(parser.parse_args(argv))
    defaults = {}
    if typed.get("model_name_or_path"):
        defaults.update(REAL_MODEL_DEFAULTS)
        if typed.get("device", "auto") != "cpu" and torch.cuda.is_available():
            defaults.update(REAL_MODEL_GPU_DEFAULTS)
    defaults.update(TASK_DEFAULTS.get(typed.get("dataset", ""), {}))
    args = Args(**{**defaults, **typed})
    ckpt = checkpoint_to_resume(args)
    # A run killed before its first whole checkpoint left its args.json: --resume auto starts that run again.
    restart = args.resume == "auto" and not ckpt and os.path.isfile(os.path.join(args.save_dir, "args.json"))
    if (ckpt and os.path.isdir(ckpt)) or restart:
        args = resumed_args(args, typed, ckpt, parser)
    for problem in check_args(args):
        parser.error(problem)
    return args


def checkpoint_to_resume(args):
    if args.resume == "auto":
        return find_checkpoint(args.save_dir)
    return args.resume or None


def resumed_args(args, typed, ckpt, parser):
    """Flags of the run that wrote ckpt (None: the one in --save_dir, restarted at step 1), with the typed ones."""
    folder = os.path.dirname(os.path.abspath(ckpt)) if ckpt else args.save_dir
    this_command = {"save_dir": typed.get("save_dir", folder), "resume": args.resume, "stop_after": args.stop_after}
    # The prompt order and a step's rows depend on the number of processes, which args.json records, and each
    # process wrote its own rng_state_<rank>.pt into a checkpoint.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    step = 0
    config = {}
    try:
        with open(os.path.join(ckpt or folder, "args.json")) as f:
            saved = json.load(f)
        trained_by = saved.pop("world_size", world)
        # A run from before --share_prompt forwarded each row's whole prompt.
        saved.setdefault("share_prompt", 0)
        resumed = Args(**{**saved, **typed, **this_command})
        if ckpt:
            trained_by = len(glob.glob(os.path.join(ckpt, "rng_state_*.pt")))
            with open(os.path.join(ckpt, "config.json")) as f:
                config = json.load(f)
            trainer_state = torch.load(os.path.join(ckpt, "trainer_state.pt"), map_location="cpu",
                                       weights_only=True, mmap=True)
            # What is left after the optimizer's, the schedule's and the scaler's state must read as a TrainState.
            for name in ("optimizer", "scheduler", "scaler"):
                trainer_state.pop(name)
            step = TrainState(**trainer_state).step
            for rank in range(min(trained_by, world)):
                torch.load(os.path.join(ckpt, f"rng_state_{rank}.pt"), weights_only=True)
    except Exception as e:
        parser.error(f"--resume: {ckpt or folder} is not a run this train_grpo.py can continue ({one_line(e)})")
    # Read from the model that trained, not from --use_moe: a model from a folder or the hub may be an MoE too.
    moe = "router_aux_loss_coef" in config or resumed.use_moe
    for name in typed:
        fixed = name not in RESUME_MAY_CHANGE
        # A cosine schedule decays over --max_steps, so there the length sets every step's learning rate.
        fixed |= name == "max_steps" and resumed.lr_scheduler == "cosine"
        # bnpo, the router loss and the entropy bonus average each micro-batch: there its size is part of the loss.
        fixed |= name == "micro_batch_size" and bool(resumed.loss_type == "bnpo" or moe
                                                     or resumed.entropy_coef or resumed.use_adaptive_entropy)
        # With a shared prompt, checkpointing decides whether the router loss counts a prompt once or once per row.
        fixed |= name == "gradient_checkpointing" and moe and bool(resumed.share_prompt)
        # The resolved value is compared, so that epsilon_high's -1 reads as the epsilon it stands for.
        value = getattr(resumed, name)
        if fixed and name in saved and value != saved[name]:
            parser.error(f"--{name} {value} differs from {saved[name]}, the value {ckpt or folder} was trained with: "
                         f"a resumed run computes what its run computed (use another --save_dir for a new run)")
    if trained_by != world:
        parser.error(f"--resume: {ckpt or folder} was trained by {trained_by} process(es) and this run has {world}: "
                     f"resume it on {trained_by} (torchrun --nproc_per_node {trained_by} train_grpo.py --resume ...)")
    if resumed.max_steps < step:
        parser.error(f"--max_steps {resumed.max_steps} is below step {step} of {ckpt}: give {step} or more")
    if 0 < resumed.stop_after <= step:
        parser.error(f"--stop_after {resumed.stop_after} is not after step {step} of {ckpt}: give a later step")
    latest = find_checkpoint(folder)
    in_its_folder = os.path.abspath(resumed.save_dir) == os.path.abspath(folder)
    if ckpt and in_its_folder and latest and step_of(latest) > step:
        # Going on from an older checkpoint in its folder would mix two histories there.
        parser.error(f"--resume {ckpt}: {latest} is later; continue with --resume auto, or branch from it into a "
                     f"new folder with --resume {ckpt} --save_dir NEW")
    rank0 = os.environ.get("RANK", "0") == "0"
    watched = ["micro_batch_size", "logp_chunk_size"]
    if resumed.share_prompt:
        # Checkpointing moves stages 5-7 between a shared prompt and whole rows: the same sums in another order.
        watched.append("gradient_checkpointing")
    changed = [f"--{n}" for n in watched if getattr(resumed, n) != saved.get(n)]
    if ckpt and changed and rank0:
        print(f"note: {' and '.join(changed)} changed at this resume: the run goes on, but the last bits of its sums "
              f"differ, so it is no longer bitwise the run that never stopped")
    if not ckpt and rank0:
        print(f"{folder} holds no whole checkpoint: its run starts again at step 1, with its flags")
    return resumed


def check_args(a):
    positive = ("batch_size max_steps max_gen_len max_prompt_len num_iterations learning_rate sft_learning_rate "
                "sft_batch_size temperature").split()
    non_negative = ("micro_batch_size logp_chunk_size beta weight_decay warmup_steps grad_clip sft_warmup_steps "
                    "save_interval save_total_limit eval_interval eval_size stop_after entropy_coef_delta "
                    "entropy_coef_min entropy_target epsilon_high num_completions_to_print").split()
    for f in dataclasses.fields(a):
        if f.type is float and not math.isfinite(getattr(a, f.name)):
            yield f"--{f.name} must be a finite number, got {getattr(a, f.name)}"
    for name in positive:
        if getattr(a, name) <= 0:
            yield f"--{name} must be > 0, got {getattr(a, name)}"
    for name in non_negative:
        if getattr(a, name) < 0:
            yield f"--{name} must be >= 0, got {getattr(a, name)}"
    if a.num_generations < 2:
        yield "--num_generations must be >= 2 (a group of 1 has no baseline)"
    if not 0 <= a.epsilon < 1:
        yield f"--epsilon must be in [0, 1), got {a.epsilon}"
    if a.importance_sampling_level == "sequence" and a.loss_type == "cispo":
        yield "--importance_sampling_level sequence (GSPO) is for the clipped objective, not --loss_type cispo"
    if a.entropy_coef_min > a.entropy_coef_max:
        yield f"--entropy_coef_min {a.entropy_coef_min} must be <= --entropy_coef_max {a.entropy_coef_max}"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not a.model_name_or_path and a.sft_warmup_steps > 0 and a.sft_batch_size < world:
        yield (f"the supervised warm-up shares --sft_batch_size {a.sft_batch_size} rows among {world} ranks, one at "
               f"least each: use --sft_batch_size >= {world} or --sft_warmup_steps 0")
    if a.eval_interval > 0 and a.eval_size == 0:
        yield f"--eval_interval {a.eval_interval} needs held-out prompts: set --eval_size > 0 or --eval_interval 0"
    if a.device == "cuda" and not torch.cuda.is_available():
        yield "--device cuda: no CUDA GPU is visible"
    if bool(a.model_name_or_path) != bool(a.dataset):
        yield "--model_name_or_path and --dataset go together (the tiny model knows only the built-in reversal task)"
    if os.path.isfile(a.save_dir):
        yield f"--save_dir {a.save_dir} is a file, not a folder"
    if a.resume not in ("", "auto") and not os.path.isdir(a.resume):
        yield f"--resume {a.resume}: no such checkpoint folder"
    if a.report_to != "none" and importlib.util.find_spec(a.report_to) is None:
        yield f"--report_to {a.report_to}: the package is not installed (pip install {a.report_to})"


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints: the model as save_pretrained writes it, plus the trainer's state, in a folder renamed when whole.
# ---------------------------------------------------------------------------------------------------------------
def rng_state():
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(args, run, state, rank):
    final = os.path.join(args.save_dir, f"checkpoint-{state.step}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    torch.save(rng_state(), os.path.join(tmp, f"rng_state_{rank}.pt"))
    if rank == 0:
        save_pretrained(unwrap(run.model), run.tokenizer, tmp)
        write_args(args, tmp, run.world)
        trainer_state = {**dataclasses.asdict(state), "optimizer": run.optimizer.state_dict(),
                         "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict()}
        torch.save(trainer_state, os.path.join(tmp, "trainer_state.pt"))
    barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        # A crash before this rename leaves the previous checkpoint as it was.
        os.replace(tmp, final)
        delete_oldest(args.save_dir, args.save_total_limit)
    barrier()
    return final


def delete_oldest(save_dir, keep):
    """A checkpoint is renamed atomically before deletion, so a kill never leaves half of one --resume auto reads."""
    if keep:
        for path in checkpoints(save_dir)[:-keep]:
            os.replace(path, path + ".deleting")
    leftovers = glob.glob(os.path.join(save_dir, "checkpoint-*.deleting"))
    leftovers += glob.glob(os.path.join(save_dir, "checkpoint-*.tmp"))
    for path in leftovers:
        shutil.rmtree(path)


def save_pretrained(model, tokenizer, where):
    from transformers.utils import logging as hf_logging
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(where, safe_serialization=True)
        tokenizer.save_pretrained(where)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def write_args(args, folder, world):
    """Every flag and the number of processes. --resume says how a command started, not what the run computes,
    so args.json records it empty."""
    with open(os.path.join(folder, "args.json"), "w") as f:
        json.dump({**dataclasses.asdict(args), "resume": "", "world_size": world}, f, indent=1)


def changed_flags(args):
    toy = Args()
    return " ".join(f"--{k} {v}" for k, v in dataclasses.asdict(args).items() if v != getattr(toy, k))


def checkpoints(save_dir):
    """The whole checkpoints in save_dir, oldest first. A folder being written or deleted has a suffix."""
    done = [p for p in glob.glob(os.path.join(save_dir, "checkpoint-*"))
            if re.fullmatch(r"checkpoint-\d+", os.path.basename(p))]
    return sorted(done, key=step_of)


def step_of(path):
    return int(path.rsplit("-", 1)[1])


def find_checkpoint(save_dir):
    done = checkpoints(save_dir)
    return done[-1] if done else None


def load_weights(model, ckpt, trust_remote_code=False):
    """A checkpoint's weights into model, read by from_pretrained, which also reads a sharded save."""
    from transformers import AutoModelForCausalLM
    try:
        saved = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                     trust_remote_code=trust_remote_code).state_dict()
    except Exception as e:
        raise TrainerError(f"checkpoint {ckpt} could not be loaded: {one_line(e)}") from None
    own = model.state_dict()
    # In sorted order, so that every rank and every run names the same weight.
    for k in sorted({*saved, *own}):
        if k not in saved or k not in own or saved[k].shape != own[k].shape:
            raise TrainerError(f"checkpoint {ckpt} is from another model: {k} is missing from one of the two, "
                               "or shaped otherwise")
    model.load_state_dict(saved)


def resume(args, ckpt, run, rank):
    """Restore a checkpoint, this rank's RNG too, and trim the logs to it; parse_args has checked its files."""
    load_weights(unwrap(run.model), ckpt, trust_remote_code=bool(args.trust_remote_code))
    # weights_only: a checkpoint holds data, never code to run.
    saved = torch.load(os.path.join(ckpt, "trainer_state.pt"), map_location="cpu", weights_only=True)
    run.optimizer.load_state_dict(saved.pop("optimizer"))
    run.scheduler.load_state_dict(saved.pop("scheduler"))
    run.scaler.load_state_dict(saved.pop("scaler"))
    state = TrainState(**saved)
    set_rng_state(torch.load(os.path.join(ckpt, f"rng_state_{rank}.pt"), weights_only=True))
    if rank == 0:
        for name in LOGS:
            trim_log(os.path.join(args.save_dir, name), state.step)
        print(f"resumed from {ckpt} at step {state.step}")
    return state


def trim_log(path, step):
    """A .jsonl log keeps its lines up to `step`, where a resume goes on. A line a kill cut short is dropped."""
    kept = []
    if os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if line.endswith("\n") and json.loads(line).get("step", 0) <= step]
    # Written aside and renamed, so that a kill leaves the log whole, trimmed or not.
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------------------------------------------------
# Logging.
# ---------------------------------------------------------------------------------------------------------------
LOGS = ("metrics.jsonl", "completions.jsonl")


def log_step(args, record, samples, rank, report=None):
    if rank != 0:
        return
    with open(os.path.join(args.save_dir, "metrics.jsonl"), "a") as f:
        f.write(json_line(record))
    if samples:
        with open(os.path.join(args.save_dir, "completions.jsonl"), "a") as f:
            for sample in samples:
                f.write(json_line(sample))
    evals = [sample for sample in samples if sample["split"] == "eval"]
    # The same held-out prompts at every eval, spread over the set, so a reader watches each answer change.
    shown = min(args.num_completions_to_print, len(evals))
    for i in range(shown):
        sample = evals[i * len(evals) // shown]
        tqdm.write(f"  step {sample['step']} held-out {cut(sample['prompt'], 40, tail=True)} -> "
                   f"{cut(sample['completion'])}, reward {sample['reward']:.3f}")
    if report is not None:
        report(record, samples)


def json_line(record):
    # NaN and infinity are not JSON, and strict readers refuse the line: they are logged as null, as TRL does.
    finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(finite) + "\n"


def cut(text, limit=60, tail=False):
    """Console text: repr escapes what would garble it; a cut prompt (tail) keeps its end, where the question is."""
    if len(text) <= limit:
        return repr(text)
    if tail:
        return "..." + repr(text[-limit:])
    return repr(text[:limit]) + "..."


def print_group(samples, G):
    """The first training group whose rewards differ (a tied group teaches nothing), else the first."""
    group = samples[:G]
    for start in range(0, len(samples), G):
        if len({sample["reward"] for sample in samples[start:start + G]}) > 1:
            group = samples[start:start + G]
            break
    tqdm.write(f"  step {group[0]['step']} training group of {cut(group[0]['prompt'], 40, tail=True)}:")
    for sample in group:
        values = " ".join(f"{name} {value}" if value is None else f"{name} {value:.3f}"
                          for name, value in sample["rewards"].items())
        tqdm.write(f"    {cut(sample['completion'])}: {values}, advantage {sample['advantage']:+.3f}")


def batch_samples(step, batch, run):
    """Training samples, each cut at completion_len: --mask_truncated_completions may zero a mask."""
    T = batch.completion_mask.shape[1]
    P = batch.input_ids.shape[1] - T
    kept = torch.arange(T, device=batch.input_ids.device) < batch.completion_len.unsqueeze(1)
    completion_ids = completion_token_ids(batch.input_ids[:, P:], kept)
    completions = run.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return completion_samples(step, "train", run, batch.input_ids[:, :P], batch.attention_mask[:, :P], completions,
                              values_per_func(batch, run), batch.rewards, batch.advantages)


def completion_samples(step, split, run, prompt_ids, prompt_mask, completions, rewards_per_func, rewards,
                       advantages=None):
    """completions.jsonl's lines, which only rank 0 logs: the prompt without its padding, each reward unweighted."""
    names = [fn.__name__ for fn in run.reward_fns]
    samples = []
    for i, completion in enumerate(completions):
        values = {}
        for k, name in enumerate(names):
            value = rewards_per_func[i, k].item()
            values[name] = None if math.isnan(value) else value
        samples.append({"step": step, "split": split, "rank": 0,
                        "prompt": run.tokenizer.decode(prompt_ids[i][prompt_mask[i].bool()]),
                        "completion": completion, "rewards": values, "reward": rewards[i].item(),
                        "advantage": None if advantages is None else advantages[i].item()})
    return samples


def open_report(args, rank, first_step):
    """A run goes on in its TensorBoard run, the points from first_step on purged (a restart's, a resume's later
    ones), and by default in a new wandb run of its group."""
    if args.report_to == "none" or rank != 0:
        return None, None
    name = args.run_name or os.path.basename(os.path.normpath(args.save_dir))
    if args.report_to == "wandb":
        import wandb
        wandb_run = wandb.init(project="train_grpo", name=name, group=name, dir=args.save_dir,
                               config=dataclasses.asdict(args))

        def send_to_wandb(record, samples):
            logged = {k: v for k, v in record.items() if k != "step"}
            if samples:
                # Each reward in a column of its own, as TRL's table, so that it sorts by one reward.
                columns = ["step", "split", "prompt", "completion", *samples[0]["rewards"], "reward", "advantage"]
                rows = []
                for sample in samples:
                    rows.append([sample["step"], sample["split"], sample["prompt"], sample["completion"],
                                 *sample["rewards"].values(), sample["reward"], sample["advantage"]])
                logged["completions"] = wandb.Table(columns=columns, data=rows)
            wandb_run.log(logged, step=record["step"])
        return send_to_wandb, wandb_run.finish
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(os.path.join(args.save_dir, "tensorboard", name), purge_step=first_step)

    def send_to_tensorboard(record, samples):
        for k, v in record.items():
            if k != "step":
                writer.add_scalar(k, v, record["step"])
        if samples:
            # Indented four spaces, the JSON lines are a code block in TensorBoard's text tab.
            lines = ["    " + json_line(sample) for sample in samples]
            writer.add_text("completions", "".join(lines), record["step"])
        writer.flush()
    return send_to_tensorboard, writer.close


def summary(args, state, eval_key, started):
    records = [json.loads(line) for line in open(os.path.join(args.save_dir, "metrics.jsonl"))]
    evals = [(r[eval_key], r["step"]) for r in records if r.get(eval_key) is not None]
    held_out = "no held-out eval"
    if evals:
        best = max(evals, key=lambda e: e[0])
        held_out = (f"held-out {eval_key} {evals[0][0]:.3f} (step {evals[0][1]}), best {best[0]:.3f} (step "
                    f"{best[1]}), last {evals[-1][0]:.3f} (step {evals[-1][1]})")
    return f"done: step {state.step} of {args.max_steps} in {time.time() - started:.0f} s; {held_out}"


# ---------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------
def main(argv=None, collect=None):
    """Parse the flags and run. `collect(args, run, prompt_rows)`, if given, replaces collect_batch in every step."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    try:
        # The built-in model is too small to gain from a second thread. OMP_NUM_THREADS, if you set it, wins.
        if not args.model_name_or_path and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)
        rank, world, device = setup_distributed(args)
        return train(args, rank, world, device, collect)
    except BaseException as e:
        # An error's traceback holds train's frame, and so the DDP wrapper. The wrapper must be freed while its
        # process group exists: freed after, it destroys the gloo group holding the GIL, which can hang the rank.
        error = e if dist.is_initialized() else None
        # A context chain can loop back on itself, so each error is cleared once.
        cleared = set()
        while error is not None and id(error) not in cleared:
            cleared.add(id(error))
            traceback.clear_frames(error.__traceback__)
            error = error.__context__
        raise
    finally:
        # A process that goes on after the run, such as a notebook, gets its thread count back.
        torch.set_num_threads(threads)
        if dist.is_initialized():
            # A wrapper caught in a reference cycle is freed now too, before the group goes.
            gc.collect()
            dist.destroy_process_group()


def cli(argv=None, collect=None):
    """main(argv, collect), with a problem of the input as one line `error: ...` and exit status 1 (a bad flag: 2)."""
    try:
        main(argv, collect)
    except TrainerError as e:
        # One write, so that two ranks' lines never interleave.
        sys.stderr.write(f"error: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
