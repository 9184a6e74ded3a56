"""Does a complete run always exit 0? Many consecutive torchrun jobs, commsched beside torch DDP.

    .venv/bin/python benchmarks/exit_soak.py --runs 100
    .venv/bin/python benchmarks/exit_soak.py --runs 20 --systems commsched --endings destroy

Each job is a 2-rank script as users write it (nanoGPT's shape): a small GPT-like
model, AdamW, gradient accumulation through ``require_backward_grad_sync``, a
checkpoint written by rank 0 from ``model.module``, and at the end either
``dist.destroy_process_group()`` ("destroy") or nothing ("no-destroy": the
interpreter's exit lets go of the groups). The systems are torch DDP and
commsched through ``prepare()``; the variants are interleaved, one job of each
in turn. A job fails if torchrun exits non-zero or any rank prints
``terminate called`` (a C++ abort). Printed: per variant, failures of runs,
with the first failure's output; with ``--json``, every job.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
import time

from commsched.bench import runner

SYSTEMS = ("commsched", "ddp")
ENDINGS = ("destroy", "no-destroy")


def train(system: str, ending: str, checkpoint_dir: str, iterations: int) -> None:
    """The job's script, run on every rank by torchrun."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import commsched

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Transformer(d_model=64, nhead=4, num_encoder_layers=2, num_decoder_layers=0,
                                 dim_feedforward=128, batch_first=True).encoder
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    if system == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        model, optimizer = commsched.prepare(model, optimizer)
    raw_model = model.module
    generator = torch.Generator().manual_seed(rank)
    micro_steps = 2
    for _ in range(iterations):
        for micro_step in range(micro_steps):
            model.require_backward_grad_sync = micro_step == micro_steps - 1
            x = torch.randn(8, 16, 64, generator=generator)
            (F.mse_loss(model(x), x) / micro_steps).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if rank == 0:
        torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict()},
                   os.path.join(checkpoint_dir, "ckpt.pt"))
    if ending == "destroy":
        dist.destroy_process_group()


def run_job(system: str, ending: str, iterations: int, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   __file__, "--job", system, ending, checkpoint_dir, str(iterations)]
        started = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            returncode, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as expired:
            returncode, output = None, f"timed out after {timeout_s} s\n{expired.stdout or ''}{expired.stderr or ''}"
        seconds = time.perf_counter() - started
        checkpointed = os.path.exists(os.path.join(checkpoint_dir, "ckpt.pt"))
    aborted = "terminate called" in output
    return {"system": system, "ending": ending, "returncode": returncode, "aborted": aborted,
            "checkpointed": checkpointed, "seconds": round(seconds, 2),
            "ok": returncode == 0 and not aborted and checkpointed,
            "output": output[-4000:]}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--job"]:
        system, ending, checkpoint_dir, iterations = argv[1:5]
        train(system, ending, checkpoint_dir, int(iterations))
        return
    parser = runner.make_parser(__doc__)
    parser.add_argument("--runs", type=int, default=100, help="jobs per variant")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--endings", nargs="+", choices=ENDINGS, default=list(ENDINGS))
    parser.add_argument("--iterations", type=int, default=12, help="optimizer steps per job")
    parser.add_argument("--timeout-s", type=float, default=90.0, help="per job")
    runner.add_json(parser, help="write every job's outcome here")
    args = parser.parse_args(argv)
    runner.refuse_below_one(parser, args, "runs")
    variants = list(itertools.product(args.systems, args.endings))
    jobs: list[dict] = []
    for run in range(args.runs):
        for system, ending in variants:
            jobs.append(run_job(system, ending, args.iterations, args.timeout_s))
            if not jobs[-1]["ok"]:
                job = jobs[-1]
                print(f"run {run}: {system}, {ending}: rc={job['returncode']} aborted={job['aborted']} "
                      f"checkpointed={job['checkpointed']}\n    " + job["output"][-1500:].replace("\n", "\n    "),
                      flush=True)
        if (run + 1) % 10 == 0:
            print(f"{run + 1} of {args.runs} runs per variant done", flush=True)
    print(f"\n{'system':<10} {'ending':<11} {'failed':>7} {'runs':>5} {'median s':>9}")
    for system, ending in variants:
        mine = [j for j in jobs if j["system"] == system and j["ending"] == ending]
        seconds = sorted(j["seconds"] for j in mine)
        failed = [j for j in mine if not j["ok"]]
        print(f"{system:<10} {ending:<11} {len(failed):>7} {len(mine):>5} {seconds[len(seconds) // 2]:>9.2f}")
    for system, ending in variants:
        failed = [j for j in jobs if j["system"] == system and j["ending"] == ending and not j["ok"]]
        if failed:
            print(f"\nfirst failure of {system}, {ending}:\n{failed[0]['output']}")
    runner.write_json(args.json, jobs)


if __name__ == "__main__":
    main()
