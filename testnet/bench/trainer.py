"""The trainer against a plain torch loop on the same model, in the same process.

    node bench trainer [--device auto|cpu|cuda] [--d-model N --layers N --heads N
                        --context N --batch N] [--steps N] [--rounds N] [--no-compile]

Four ways to train the byte-level GPT (node/ml/trainer/models.py), each from the same
initial weights on the same batches:

- `plain loop`: what a torch user writes: `torch.optim.AdamW` (fused on CUDA), bf16
  autocast on CUDA, clipping at 1.0, no read-back to the host per step;
- `plain loop + torch.compile`: the same loop with `torch.compile(model)`;
- `peertrain Trainer`: `Trainer.step()` as the node runs it (node/ml/trainer/loop.py), with
  `compile` off;
- `peertrain Trainer + compile`: the same with `compile` on, timed once its compile
  (beside training) is ready.

Steps are timed in blocks of `steps` (the device synchronized at both ends, and the
trainer's pending read-back done), interleaved over `rounds` so a change in load hits every
variant alike; the table gives the median block. Tokens/s = batch x context / step time.
MFU (model FLOP utilization, PaLM appendix B, as nanoGPT's `estimate_mfu`) = (6N + 12 L h T)
FLOPs per token x tokens/s / the device's peak: bf16 dense tensor-core peak on NVIDIA GPUs
(a table below; `--peak-tflops` for others), and for a CPU threads x clock x FLOPs per cycle
(fp32 FMA: 32 with AVX2, 64 with AVX-512), a nominal figure.

Results go to docs/benchmarks.md, section `trainer`, in a block per device kind
(`trainer-cpu`, `trainer-cuda`), so a GPU run leaves the CPU rows in place and vice versa.
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testnet.bench.report import DOC, machine, md_table, write_section

# bf16 dense peak FLOP/s by GPU name (vendor data sheets), longest match first
GPU_PEAKS = (("H100 PCIe", 756e12), ("H100", 989.4e12), ("H200", 989.4e12),
             ("GH200", 989.4e12), ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12),
             ("A10G", 70e12), ("RTX 4090", 165e12), ("RTX 3090", 71e12))

CPU_SHAPE = dict(d_model=128, layers=4, heads=4, context=128, batch=16)  # the demo model
CUDA_SHAPE = dict(d_model=768, layers=12, heads=12, context=1024, batch=16)  # issue 29's 86M


@dataclass
class Variant:
    name: str
    step: Callable[[], None]  # one training step, no read-back of its own
    settle: Callable[[], None]  # wait until every queued step is done
    compile_s: float | None = None
    note: str = ""
    blocks: list[float] | None = None  # seconds per step, one per timed block
    cpu: list[float] | None = None  # process CPU seconds per step, one per timed block


def gpu_peak(name: str) -> float | None:
    for key, peak in GPU_PEAKS:
        if key in name:
            return peak
    return None


def cpu_peak(threads: int) -> tuple[float | None, str]:
    """threads x clock x fp32 FLOPs per cycle, from /proc/cpuinfo (nominal)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None, "no /proc/cpuinfo"
    mhz = re.search(r"^cpu MHz\s*:\s*([\d.]+)", info, re.M)
    flags = re.search(r"^flags\s*:(.*)$", info, re.M)
    if not mhz or not flags:
        return None, "no clock or flags in /proc/cpuinfo"
    have = set(flags.group(1).split())
    per_cycle = 64 if "avx512f" in have else 32 if {"avx2", "fma"} <= have else 8
    ghz = float(mhz.group(1)) / 1000
    return (threads * ghz * 1e9 * per_cycle,
            f"{threads} thread(s) x {ghz:.2f} GHz x {per_cycle} fp32 FLOPs/cycle")


def flops_per_token(n_params: int, layers: int, d_model: int, context: int) -> float:
    return 6 * n_params + 12 * layers * d_model * context


def build_variants(device: str, shape: dict[str, int], threads: int, compile_: bool,
                   seed: int = 0) -> tuple[list[Variant], Any, int]:
    import torch

    from node.ml.trainer.loop import TrainConfig, Trainer, derive_seed
    from node.ml.trainer.tasks import TaskConfig, build_task

    task = build_task(TaskConfig(name="bytes-gpt", d_model=shape["d_model"],
                                 n_layers=shape["layers"], n_heads=shape["heads"],
                                 context=shape["context"], max_bytes=8_000_000))
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    half = cuda and torch.cuda.is_bf16_supported()
    batch = shape["batch"]

    def plain(compiled: bool) -> Variant:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, "init"))
            model = task.build_model().to(dev)
        params = list(model.parameters())
        opt = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=2e-3, betas=(0.9, 0.95), fused=cuda)
        forward = torch.compile(model) if compiled else model
        gen = torch.Generator().manual_seed(derive_seed(seed, "data", 0))

        def step() -> None:
            x, y = task.train_batch(batch, gen)
            if cuda:
                x, y = x.pin_memory(), y.pin_memory()
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with (torch.autocast("cuda", dtype=torch.bfloat16) if half
                  else contextlib.nullcontext()):
                loss = task.loss(forward(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        variant = Variant("plain loop + torch.compile" if compiled else "plain loop", step,
                          settle)
        if compiled:  # torch.compile compiles on the first call (forward and backward)
            started = time.perf_counter()
            step()
            settle()
            variant.compile_s = time.perf_counter() - started
        return variant

    def settle() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def ours(compiled: bool) -> Variant:
        started = time.perf_counter()
        trainer = Trainer(task, TrainConfig(device=device, batch_size=batch, eval_every=0,
                                            threads=threads, seed=seed, compile=compiled,
                                            warmup_steps=0))
        variant = Variant("peertrain Trainer + compile" if compiled else "peertrain Trainer",
                          lambda: trainer.step(), lambda: (trainer.flush(), settle()))
        if compiled:  # a node trains eager meanwhile; here the compile gets the cores
            trainer.compile_done.wait()
            variant.compile_s = time.perf_counter() - started
            if trainer.compile_status != "ready":
                variant.note = trainer.compile_status
        variant.note = variant.note or (f"fused AdamW {trainer.optimizer.fused}, read back "
                                        f"every {trainer.sync_every}")
        return variant

    torch.set_num_threads(threads)
    n_params = sum(p.numel() for p in task.build_model().parameters())
    variants = [plain(False), ours(False)]
    if compile_:
        variants += [plain(True), ours(True)]
    return variants, torch, n_params


def measure(variants: list[Variant], steps: int, rounds: int, warmup: int) -> None:
    for v in variants:
        for _ in range(warmup):
            v.step()
        v.settle()
        v.blocks, v.cpu = [], []
    for _ in range(rounds):  # interleaved: a change in load hits every variant alike
        for v in variants:
            v.settle()
            started, cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                v.step()
            v.settle()
            assert v.blocks is not None and v.cpu is not None
            v.blocks.append((time.perf_counter() - started) / steps)
            v.cpu.append((time.process_time() - cpu) / steps)


def main(device: str = "auto", quick: bool = False, d_model: int | None = None,
         layers: int | None = None, heads: int | None = None, context: int | None = None,
         batch: int | None = None, steps: int | None = None, rounds: int | None = None,
         compile_: bool = True, threads: int = 1, peak_tflops: float | None = None,
         doc: Path | None = None) -> str:
    import torch
    from rich.console import Console

    console = Console()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device.startswith("cuda")
    shape = dict(CUDA_SHAPE if cuda else CPU_SHAPE)
    for key, value in (("d_model", d_model), ("layers", layers), ("heads", heads),
                       ("context", context), ("batch", batch)):
        if value is not None:
            shape[key] = value
    steps = steps or (5 if quick else 20 if cuda else 10)
    rounds = rounds or (2 if quick else 5 if cuda else 3)
    load = [os.getloadavg()[0]]
    started = time.perf_counter()
    variants, torch, n_params = build_variants(device, shape, threads, compile_)
    measure(variants, steps, rounds, warmup=2 if quick else 3)
    load.append(os.getloadavg()[0])
    wall = time.perf_counter() - started

    if cuda:
        name = torch.cuda.get_device_name(torch.device(device))
        peak = gpu_peak(name) if torch.cuda.is_bf16_supported() else None
        peak_note = f"{name}, bf16 dense peak {peak / 1e12:.0f} TFLOP/s" if peak else name
    else:
        name = "CPU"
        peak, peak_note = cpu_peak(threads)
    if peak_tflops:
        peak, peak_note = peak_tflops * 1e12, f"{peak_tflops} TFLOP/s (given)"
    fpt = flops_per_token(n_params, shape["layers"], shape["d_model"], shape["context"])
    tokens = shape["batch"] * shape["context"]
    base = next((v for v in variants if v.name == "plain loop + torch.compile"), variants[0])
    base_s = statistics.median(base.blocks or [])
    base_cpu = statistics.median(base.cpu or [])
    rows = []
    for v in variants:
        blocks, cpu = v.blocks or [], v.cpu or []
        s, c = statistics.median(blocks), statistics.median(cpu)
        mfu = f"{fpt * tokens / s / peak:.1%}" if peak else "-"
        rows.append([v.name, f"{s * 1e3:.1f}", f"{min(blocks) * 1e3:.1f}-{max(blocks) * 1e3:.1f}",
                     f"{c * 1e3:.1f}", f"{tokens / s:,.0f}", mfu,
                     f"{base_s / s:.2f}x / {base_cpu / c:.2f}x",
                     "-" if v.compile_s is None else f"{v.compile_s:.1f}", v.note])
    headers = ["variant", "ms/step (median)", "ms/step (range)", "CPU ms/step", "tokens/s",
               "MFU", f"speed vs {base.name} (wall / CPU)", "compile s", "notes"]
    table = md_table(headers, rows)
    console.print(table)
    kind = "cuda" if cuda else "cpu"
    command = ("node bench trainer --device " + kind + (" --quick" if quick else "")
               + ("" if compile_ else " --no-compile"))
    shape_text = (f"d_model {shape['d_model']}, {shape['layers']} layers, {shape['heads']} "
                  f"heads, context {shape['context']}, batch {shape['batch']} "
                  f"({n_params / 1e6:.2f}M parameters)")
    text = (f"### {'CUDA' if cuda else 'CPU'}\n\n`{command}` on {machine()}; {peak_note}. "
            f"Model: {shape_text}; {threads} torch thread(s); {rounds} interleaved rounds of "
            f"{steps} timed steps per variant after warm-up; 1-minute load average "
            f"{min(load):.1f}-{max(load):.1f} during the run ({wall:.0f} s in all).\n\n"
            f"{table}\n\nms/step, tokens/s and MFU are wall time; CPU ms/step is the process's "
            "CPU time per step (all its threads), the figure that other work on the machine "
            "moves least" + (" (on CUDA it is the host's share: launches and Python)" if cuda
                             else "") + ".\n")
    write_block(kind, text, doc or DOC)
    return text


INTRO = """## Training: the trainer against a plain torch loop

`node bench trainer` trains the byte-level GPT four ways in one process, from the same
weights on the same batches (testnet/bench/trainer.py): a plain torch loop (torch's AdamW,
fused on CUDA; no read-back per step), that loop under `torch.compile`, and
`Trainer.step()` with `train.compile` off and on. MFU = (6N + 12·L·h·T) FLOPs per token x
tokens/s / peak. Goal (issue 29): on the H100, the Trainer at >= 1.0x the compiled plain loop
(MFU >= 39% for the 86M model).

On a machine with a GPU, one command measures the 86M model (d_model 768, 12 layers, 12
heads, context 1024, batch 16) and rewrites the CUDA block below, leaving the CPU one:

    node bench trainer --device cuda

It takes about a minute on an H100 (the plain loop's compile, about 20 s with inductor's
cache cold; the Trainer's own then takes 1 s from that cache; then 4 variants x 5 rounds x
20 steps). The CPU run
(`node bench trainer --device cpu`, the demo model) rewrites the CPU block. `make
bench-gpu` (testnet/bench/gpu_checks.sh, about 4 minutes on an H100) runs this, the same at
batch 32, the CUDA paths' tests (the memory estimate against the measured peak, fused AdamW
against torch's, the NaN caught on the GPU, accumulation, a real `torch.compile` beside
training) and a join's compile timing (testnet/bench/gpu_join.py) in one go.
"""


def write_block(kind: str, text: str, doc: Path) -> None:
    """The device's block inside the `trainer` section, the section made when missing."""
    current = doc.read_text() if doc.exists() else ""
    if "<!-- bench:trainer:start -->" not in current:
        empty = {k: f"### {k.upper()}\n\nNot measured yet: `node bench trainer --device {k}`."
                 for k in ("cpu", "cuda")}
        write_section("trainer", INTRO + "".join(
            f"\n<!-- bench:trainer-{k}:start -->\n{empty[k]}\n<!-- bench:trainer-{k}:end -->\n"
            for k in ("cpu", "cuda")), doc)
    write_section(f"trainer-{kind}", text, doc)
