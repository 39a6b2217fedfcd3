"""Run the fuzz targets: `python -m tests.fuzz --target all --seconds 60` (a long run) or
`--runs 300 --seed 1` (bounded and deterministic, what tests/protocols/test_fuzz.py runs).

protocols/ is imported under atheris' bytecode instrumentation, then each target runs in a
forked child (libFuzzer's loop ends the process it runs in), one at a time, bounded by
`-max_total_time` or `-runs`, `-timeout` per input and `-rss_limit_mb`. The parent parses
libFuzzer's report and prints one line per target: executions, edges covered ("cov") and
features ("ft") after the seeds and at the end, and the crash, if any (its input is saved
under --artifacts). Exit status 1 if any target crashed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Result:
    target: str
    executions: int
    seconds: int
    cov_seeds: int  # edges covered once the seeds have run
    cov: int  # edges covered at the end
    ft: int  # libFuzzer features (edges x hit-count buckets) at the end
    corpus: int  # inputs kept as interesting
    crash: str  # "" or the first line of what went wrong, and the saved input


def _parse(name: str, log: str, status: int) -> Result:
    def stat(key: str) -> int:
        m = re.search(rf"stat::{key}:\s*(\d+)", log)
        return int(m.group(1)) if m else 0

    lines = re.findall(r"cov: (\d+) ft: (\d+)(?: corp: (\d+))?", log)
    inited = re.search(r"INITED cov: (\d+)", log)
    cov, ft, corp = (int(x or 0) for x in lines[-1]) if lines else (0, 0, 0)
    crash = ""
    if status != 0:
        what = re.search(r"(Uncaught Python exception: .*?\n(?:.*\n){0,40}?\w*Error.*|"
                         r"==\d+== ERROR: libFuzzer: [^\n]*)", log)
        artifact = re.search(r"Test unit written to (\S+)", log)
        crash = (what.group(0).strip().splitlines()[-1] if what else f"exit status {status}")
        crash += f" (input: {artifact.group(1)})" if artifact else ""
    progress = re.findall(r"^#(\d+)", log, re.MULTILINE)  # a crash prints no final stats
    executions = stat("number_of_executed_units") or (int(progress[-1]) if progress else 0)
    return Result(name, executions, 0,
                  int(inited.group(1)) if inited else 0, cov, ft, corp, crash)


def _fuzz(name: str, flags: list[str], corpus: Path, log: Path) -> int:
    """Run one target in a forked child with `flags`; its exit status."""
    import atheris

    from tests.fuzz import targets

    corpus.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(targets.seeds(name)):
        (corpus / f"seed-{i}").write_bytes(seed)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: libFuzzer owns it and ends it
        status = 3
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            atheris.Setup(
                [f"fuzz-{name}", *flags, str(corpus)],
                lambda data: targets.run(name, data),
            )
            atheris.Fuzz()
            status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    parser.add_argument("--target", default="all", help="a name, a comma list, or all")
    bound = parser.add_mutually_exclusive_group(required=True)
    bound.add_argument("--seconds", type=int, help="per target")
    bound.add_argument("--runs", type=int, help="executions per target")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--corpus", type=Path, help="keep corpora here (default: a temp dir)")
    parser.add_argument("--artifacts", type=Path, default=Path(tempfile.gettempdir()) / "fuzz")
    parser.add_argument("--json", action="store_true", help="print results as JSON lines")
    args = parser.parse_args(argv)

    import atheris

    with atheris.instrument_imports(include=["protocols"]):
        from tests.fuzz import targets
    names = list(targets.TARGETS) if args.target == "all" else args.target.split(",")
    unknown = set(names) - set(targets.TARGETS)
    if unknown:
        parser.error(f"unknown targets {sorted(unknown)}; known: {list(targets.TARGETS)}")
    bound_flag = f"-max_total_time={args.seconds}" if args.seconds else f"-runs={args.runs}"
    args.artifacts.mkdir(parents=True, exist_ok=True)
    crashed = False
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        for name in names:
            corpus = (args.corpus or Path(tmp)) / name
            flags = [bound_flag, f"-seed={args.seed}", "-timeout=10", "-rss_limit_mb=2048",
                     "-max_len=65536", "-print_final_stats=1",
                     f"-artifact_prefix={args.artifacts}/{name}-"]
            log = Path(tmp) / f"{name}.log"
            status = _fuzz(name, flags, corpus, log)
            result = _parse(name, log.read_text(errors="replace"), status)
            result.seconds = args.seconds or 0
            crashed |= bool(result.crash)
            if args.json:
                print(json.dumps(asdict(result)), flush=True)
            else:
                print(f"{name:20} {result.executions:>10} execs  cov {result.cov_seeds:>5}"
                      f" -> {result.cov:<5} ft {result.ft:<6} corpus {result.corpus:<5}"
                      f" {result.crash or 'ok'}", flush=True)
            if result.crash:
                print(log.read_text(errors="replace")[-6000:], file=sys.stderr, flush=True)
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
