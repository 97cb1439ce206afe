"""Shared by the tests: run the CLI, spawn 2 gloo processes, make a tiny model and tokenizer."""
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train_grpo.py")
sys.path.insert(0, ROOT)
import train_grpo as tg  # noqa: E402

# small and fast: 4 prompts x 4 completions per rank, no warmup, a short eval
FAST = ["--batch_size", "4", "--num_generations", "4", "--max_gen_len", "6", "--sft_warmup_steps", "0",
        "--eval_size", "16", "--eval_interval", "0"]


def env1():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # no test reaches for a hub
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def cli_command(args, nproc):
    args = [str(a) for a in args]
    if nproc == 1:
        return [sys.executable, TRAIN, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(free_port()), TRAIN, *args]


def run_cli(*args, nproc=1, timeout=600):
    return run_clis(args, nproc=nproc, timeout=timeout)[0]


def run_clis(*runs, nproc=1, timeout=600):
    """Independent CLI runs side by side (each its own process): a list of CompletedProcess, in order."""
    return run_commands(*(cli_command(args, nproc) for args in runs), timeout=timeout)


def run_commands(*commands, timeout=600):
    """Commands side by side, each in its own session, all within `timeout` s. Past it every session is killed
    whole (torchrun's workers too, not only the launcher), then subprocess.TimeoutExpired is raised."""
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env=env1(), start_new_session=True) for command in commands]
    deadline, done = time.time() + timeout, []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(deadline - time.time(), 0.01))
            except subprocess.TimeoutExpired:
                raise subprocess.TimeoutExpired(p.args, timeout) from None
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.returncode is None:  # not reaped: its group id is still its own, no one else's
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return done


def free_port():
    return free_ports(1)[0]


def free_ports(n):
    """n distinct free ports: every socket stays bound until all are chosen, so none is handed out twice (a
    second process group at a port the first one used could hang)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _entry(rank, world, port, fn, args, done_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    fn(rank, world, *args)
    # The ranks leave together, and without the interpreter's teardown. Rank 0 hosts the rendezvous
    # store (torchrun's agent hosts it for the trainer), and a gloo or store thread still running
    # when its peer's process is gone can abort (SIGABRT) a worker that did everything right.
    open(os.path.join(done_dir, str(rank)), "w").close()
    deadline = time.time() + 600
    while len(os.listdir(done_dir)) < world and time.time() < deadline:
        time.sleep(0.05)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, *args, world=2, timeout=600):
    """Run fn(rank, world, *args) in `world` processes with the env:// variables torchrun would set.
    A rank that fails fails the test; ranks that hang (a collective one rank never joins) too."""
    with tempfile.TemporaryDirectory() as done_dir:
        ctx = mp.spawn(_entry, args=(world, free_port(), fn, args, done_dir), nprocs=world, join=False)
        deadline = time.time() + timeout
        while not ctx.join(timeout=2):
            if time.time() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"the ranks hung for {timeout} s")


_SUITE = {}


def dist_suite():
    """The folder of what dist_workers' 2-rank workers saved for test_ddp, test_entropy, test_loop and
    test_distribution. They run once per session, one after the other in one pair of processes (a pair's start-up
    costs more than most workers); a failure is raised again to every test that reads the folder."""
    if not _SUITE:
        import atexit
        import shutil
        import dist_workers
        out = tempfile.mkdtemp(prefix="dist_suite_")
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        run = FAST + ["--max_steps", "3"]
        jobs = [("train", (run + ["--use_adaptive_entropy", "1", "--entropy_target", "5.0", "--entropy_coef_delta",
                                  "0.001", "--save_dir", os.path.join(out, "run")], out, False, "train")),
                ("train", (run + ["--save_dir", os.path.join(out, "bypass")], out, True, "bypass")),
                ("train", (run + ["--use_moe", "1", "--micro_batch_size", "6", "--save_dir",
                                  os.path.join(out, "moe_run")], out, False, "moe_train")),
                ("teardown", (out, run + ["--save_dir", os.path.join(out, "cycle")], "cycle")),
                ("teardown", (out, run + ["--save_dir", os.path.join(out, "error")], "error")),
                ("teardown", (out, run + ["--save_dir", os.path.join(out, "context_cycle")], "context_cycle")),
                *((name, (out,)) for name in ("moe_empty_expert", "entropy_world", "batch_std_world",
                                              "loop_step_grads", "warm_up_grads", "world_quantities"))]
        try:
            spawn(dist_workers.suite, out, jobs, free_ports(len(jobs)))
            _SUITE["out"] = out
        except Exception as e:
            _SUITE["error"] = e
    if "error" in _SUITE:
        raise RuntimeError("the 2-rank workers failed: see the exception above") from _SUITE["error"]
    return pathlib.Path(_SUITE["out"])


def rollout_with_scores(model, tok, prompts, max_gen_len=6, temperature=1.0, do_sample=True, seed=0,
                        static_cache=False):
    """tg.rollout on these prompt rows, with generate's own processed scores [rows, T, V] captured (the trainer's
    generation config, plus output_scores). Returns input ids, attention mask, completion ids, mask, scores."""
    real, captured = model.generate, {}

    def generate(**kw):
        kw["generation_config"].output_scores = kw["generation_config"].return_dict_in_generate = True
        out = real(**kw)
        captured["scores"] = torch.stack(out.scores, 1)
        return out.sequences
    model.generate = generate
    ids, am, _ = tg.tokenize_prompts(tok, prompts, 256, "cpu")
    torch.manual_seed(seed)
    try:
        comp, mask, _ = tg.rollout(model, ids, am, tok, max_gen_len=max_gen_len, do_sample=do_sample,
                                   temperature=temperature, static_cache=static_cache)
    finally:
        del model.generate
    return torch.cat([ids, comp], 1), torch.cat([am, mask], 1), comp, mask, captured["scores"]


def tiny(use_moe=0, seed=0):
    torch.manual_seed(seed)
    tok = tg.build_char_tokenizer(tg.REVERSE_ALPHABET + "=")
    return tg.build_tiny_model(len(tok), use_moe, tok), tok


def sample_batch(model, tok, n_prompts=4, G=4, seed=0, max_gen_len=6):
    """A real rollout of the tiny model: input_ids [rows, P+T], attention mask, completion ids and mask."""
    train_rows, _ = tg.make_reverse_task(16)
    torch.manual_seed(seed)
    prompts = [r["prompt"] for r in train_rows[seed * n_prompts:(seed + 1) * n_prompts] for _ in range(G)]
    ids, am, _ = tg.tokenize_prompts(tok, prompts, 64, "cpu")
    comp, mask, *_ = tg.rollout(model, ids, am, tok, max_gen_len=max_gen_len)
    return torch.cat([ids, comp], 1), torch.cat([am, mask], 1), comp, mask


def step_on_batch(args, run, batch, state=None):
    """One real tg.grpo_step whose rollout is `batch` (prompt + completion ids, attention mask, completion mask,
    the advantages) instead of a sampled one; old and reference log-probs are the step's own. Returns the step's
    record and the gradients the optimizer's step received (unscaled, clipped as --grad_clip says; None: no
    gradient), one list per update, in the optimizer's parameter order."""
    P = batch["input_ids"].shape[1] - batch["mask"].shape[1]
    rows = batch["input_ids"].shape[0]
    received = []
    hook = run.optimizer.register_step_pre_hook(lambda opt, *_: received.append(
        [None if p.grad is None else p.grad.clone() for g in opt.param_groups for p in g["params"]]))
    stand_ins = dict(
        tokenize_prompts=lambda *a, **k: (batch["input_ids"][:, :P], batch["attention_mask"][:, :P], 0),
        rollout=lambda *a, **k: (batch["input_ids"][:, P:], batch["mask"], torch.zeros(rows, dtype=torch.bool)),
        score_completions=lambda *a, **k: torch.zeros(rows, 0, dtype=torch.float64),
        compute_rewards=lambda *a, **k: torch.zeros(rows), compute_advantages=lambda *a, **k: batch["advantages"])
    real = {k: getattr(tg, k) for k in stand_ins}
    for k, v in stand_ins.items():
        setattr(tg, k, v)
    try:
        record, _ = tg.grpo_step(args, run, [{"prompt": ""}] * (rows // args.num_generations), state or tg.TrainState())
    finally:
        for k, v in real.items():
            setattr(tg, k, v)
        hook.remove()
    return record, received


def make_run(model, tok=None, optimizer=None, world=1, fp16=False, reward_fns=(), weights=(), scheduler=None):
    """The Run for a test that calls grpo_step or its stages directly."""
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    if scheduler is None and optimizer is not None:  # a constant rate
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return tg.Run(model, None, optimizer, scheduler, scaler, tok, list(reward_fns), list(weights), world,
                      torch.device("cpu"))  # grpo_step reads device.type


def rewards_of_functions(fns, weights, prompts, completions, completion_ids, rows):
    """r as collect_batch computes it: each function's values (score_completions), then their weighted sum."""
    return tg.compute_rewards(tg.score_completions(fns, prompts, completions, completion_ids, rows), weights)


def evaluate_with(model, tok, rows, reward, args, rank=0, world=1, per_call=0):
    """tg.evaluate of `model` on `rows`, scored by one reward function of weight 1: its eval_reward."""
    run = make_run(model, tok, world=world, reward_fns=[reward], weights=[1.0])
    return tg.evaluate(args, run, rows, "eval_reward", rank, step=0, per_call=per_call)[0]["eval_reward"]
