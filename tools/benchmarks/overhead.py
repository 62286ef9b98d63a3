"""What the harness costs a step: the DDP transformer script against a bare loop of the same training.

``python -m tools.benchmarks.benchmark --overhead [--model PRESET]`` runs both, one process each, in turns
(script, bare, script, bare...), so that a machine that slows down meanwhile slows both. The bare
loop trains the same GPT (the script's own defaults for the preset), on the same synthetic Markov
data, with the same batch, AdamW and gradient clipping, and nothing else: no wrapper, no schedule,
no evaluation, no logging, no checkpoints. Both time the steps after the same warm-up.
"""

from __future__ import annotations

import json
import runpy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common.training import synchronize
from tools.processes import output_of, scratch_folder
from tools.records import final_record

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "ddp/train_transformer.py"


def script_defaults(model: str, run_dir: Path) -> Any:
    """The script's flags as its parser fills them for ``--model``: the training the bare loop repeats.
    ``run_dir``: a folder that does not exist, so that no earlier run in the default one refuses them."""
    parse_args = runpy.run_path(str(REPO / SCRIPT))["parse_args"]
    return parse_args(["--model", model, "--device", "cpu", "--run-dir", str(run_dir)])


def bare_loop(model: str, warmup: int, steps: int, run_dir: Path) -> dict[str, float]:
    """Mean ms a step of the bare loop over ``steps`` steps after ``warmup``, in this process, and the bytes of
    the parameters it trained (the script's final record says its own)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from common.data import markov_data
    from common.models import GPT, gpt_config

    args = script_defaults(model, run_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # as the script's --device auto
    torch.manual_seed(args.seed)
    data = markov_data(args.block_size, args.train_sequences, args.heldout_sequences)
    gpt = GPT(gpt_config(args, data.vocab_size), seed=args.seed).to(device)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    loader = DataLoader(data.train, batch_size=args.batch_size, shuffle=True, drop_last=True)
    batches = iter(loader)
    started = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            synchronize(device)
            started = time.perf_counter()
        try:
            inputs, targets = next(batches)
        except StopIteration:
            batches = iter(loader)
            inputs, targets = next(batches)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        loss = F.cross_entropy(gpt(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(gpt.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    step_ms = 1000 * (time.perf_counter() - started) / steps
    return {"step_ms": step_ms, "parameter_bytes": sum(p.numel() * p.element_size() for p in gpt.parameters())}


def script_run(model: str, warmup: int, steps: int, run_dir: Path) -> dict[str, float]:
    """The script's own mean step time (its final record's step_ms, which leaves out the first log interval:
    the warm-up), run as ``python ddp/train_transformer.py``."""
    total = warmup + steps
    command = [
        *(sys.executable, SCRIPT, "--model", model, "--device", "auto", "--run-dir", str(run_dir)),
        *("--max-steps", str(total), "--log-interval", str(warmup), "--eval-interval", str(total)),
    ]
    returncode, output = output_of(command, cwd=REPO)
    if returncode != 0:
        sys.exit(f"{' '.join(command)} failed (exit code {returncode}):\n{output}")
    record = final_record(run_dir)
    return {"step_ms": record["step_ms"], "parameter_bytes": record["local_state_bytes"]["params"]}


def bare_run(model: str, warmup: int, steps: int, run_dir: Path) -> dict[str, float]:
    """``bare_loop`` in a process of its own, as the script has one."""
    call = f"bare_loop({model!r}, {warmup}, {steps}, Path({str(run_dir)!r}))"
    code = (
        "import json; from pathlib import Path; from tools.benchmarks.overhead import bare_loop; "
        f"print(json.dumps({call}))"
    )
    returncode, output = output_of([sys.executable, "-c", code], cwd=REPO)
    if returncode != 0:
        sys.exit(f"the bare loop failed (exit code {returncode}):\n{output}")
    return json.loads(output.strip().splitlines()[-1])


def measure(model: str, warmup: int, steps: int, rounds: int) -> dict[str, Any]:
    """Interleaved runs of the script and the bare loop; their medians and the ratio."""
    ours, bare, parameter_bytes = [], [], set()
    with scratch_folder("overhead-") as scratch:
        for round_ in range(rounds):
            script = script_run(model, warmup, steps, scratch / f"script-{round_}")
            loop = bare_run(model, warmup, steps, scratch / "bare-loop")
            ours.append(script["step_ms"])
            bare.append(loop["step_ms"])
            parameter_bytes |= {script["parameter_bytes"], loop["parameter_bytes"]}
            print(f"round {round_ + 1}/{rounds}: script {ours[-1]:.2f} ms/step, bare loop {bare[-1]:.2f}", flush=True)
    if len(parameter_bytes) != 1:
        sys.exit(f"the script and the bare loop trained models of other sizes: {sorted(parameter_bytes)} bytes")
    script_median, bare_median = statistics.median(ours), statistics.median(bare)
    return {
        "model": model,
        "warmup": warmup,
        "steps": steps,
        "script_ms": ours,
        "bare_ms": bare,
        "script_median_ms": script_median,
        "bare_median_ms": bare_median,
        "ratio": script_median / bare_median,
        "parameter_bytes": parameter_bytes.pop(),
    }


def overhead_table(result: dict[str, Any]) -> str:
    return "\n".join([
        "| model | script ms/step | bare loop ms/step | ratio |",
        "| --- | ---: | ---: | ---: |",
        f"| {result['model']} | {result['script_median_ms']:.2f} | {result['bare_median_ms']:.2f} "
        f"| {result['ratio']:.3f} |",
    ])  # fmt: skip
