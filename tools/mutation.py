"""Mutation score of chosen modules with mutmut 3, each against a fast subset of the tests.

    python tools/mutation.py                   # every module below, smallest first
    python tools/mutation.py cache search      # those whose path contains "cache" or "search"
    python tools/mutation.py --diffs plan      # also print `mutmut show` of each survivor
    python tools/mutation.py --minutes 10      # stop each module after 10 minutes
    python tools/mutation.py --resume train    # go on with the mutants not yet checked
    python tools/mutation.py --report          # the table of the runs so far, running nothing

Needs mutmut (pip install -e '.[mutation]'). For each module a copy of the project
(src/, tests/, pyproject.toml with a generated [tool.mutmut] section that mutates only
that module and selects its tests) is made in build/mutation/<module>/; `mutmut run`
runs there, then `mutmut results --all true` is read back. To look at a mutant later:
cd build/mutation/<module> && mutmut show NAME. mutmut 3 leaves decorated functions
alone, so in the copy a module-level @torch.no_grad() is applied after the definition
instead (greedy_search, beam_search, evaluate); @property getters stay unmutated.

Prints one row per module and the survivors. score = (killed + timeout) / (mutants -
no tests - not checked): a mutant that no selected test executes, or that a time limit
left unrun, is left out; a timeout counts as detected; suspicious or segfault ones
count as not detected.
Exits 1 only when mutmut itself fails (clean tests failing, results unreadable), never
because mutants survived. --minutes stops a module's run after that long and reports
the mutants checked so far (marked "partial").
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "mutation"

# modules under src/mhsa, each mutated against the tests that mirror it (tests_for)
MODULES = [
    "core/kernels/dropout.py",
    "models/beam_search.py",
    "apps/serve/scheduler.py",
    "cache/contiguous.py",
    "cache/paged.py",
    "cache/blocks.py",
    "core/kernels/paged.py",
    "core/attention.py",
    "nn/positional.py",
    "core/kernels/plan.py",
    "apps/train.py",
    "core/kernels/merge.py",
    "core/masks/causal.py",
]


def tests_for(module: str) -> list[str]:
    """The tests of src/mhsa/<module>, read off the layout: tests/<its folder>/test_<its
    name>*.py, or every test file of that folder when none is named after it (then of
    the folder above, and so on); the slow ones left out, as mutmut runs them per mutant."""
    path = Path(module)
    folder = ROOT / "tests" / path.parent
    chosen = sorted(folder.glob(f"test_{path.stem}*.py"))
    while not chosen and folder != ROOT / "tests":
        chosen = sorted(folder.glob("test_*.py"))
        folder = folder.parent
    if not chosen:
        raise SystemExit(f"no tests mirror {module}: add tests/{path.parent}/test_{path.stem}.py")
    return [str(test.relative_to(ROOT)) for test in chosen] + ["-m", "not slow"]


STATUSES = ["killed", "survived", "timeout", "suspicious", "no tests", "not checked", "other"]


def mutmut_config(module: str, tests: list[str]) -> str:
    """The [tool.mutmut] section that mutates `module` only and runs `tests`."""

    def toml_list(items: list[str]) -> str:
        return "[" + ", ".join(f'"{item}"' for item in items) + "]"

    return (
        "\n[tool.mutmut]\n"
        'source_paths = ["src"]\n'
        f'only_mutate = ["src/mhsa/{module}"]\n'
        f"pytest_add_cli_args_test_selection = {toml_list(tests)}\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider"]\n'
        # every run (stats, clean, each mutant) in a fresh fork of a process that only
        # collected the tests: torch is not fork-safe after use, and a test that changes
        # shared state (test_gpt once popped its parametrize dicts) would make a second
        # run in one process unclean
        'process_isolation = "forkserver"\n'
    )


def workdir(module: str) -> Path:
    return WORK / module.replace("/", "-").removesuffix(".py")


def prepare(module: str, tests: list[str], resume: bool) -> Path:
    """A copy of the project for one module's run (kept as it is with resume)."""
    work = workdir(module)
    if resume and (work / "mutants").is_dir():
        return work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis")
    for folder in ("src", "tests"):
        shutil.copytree(ROOT / folder, work / folder, ignore=ignore)
    pyproject = (ROOT / "pyproject.toml").read_text()
    # drop a [tool.mutmut] section the project may have: this run's settings replace it
    pyproject = re.sub(r"(?ms)^\[tool\.mutmut\].*?(?=^\[|\Z)", "", pyproject)
    (work / "pyproject.toml").write_text(pyproject + mutmut_config(module, tests))
    undecorate(work / "src" / "mhsa" / module)
    return work


def undecorate(path: Path) -> None:
    """mutmut 3 skips decorated functions; a module-level `@torch.no_grad()` becomes
    `name = torch.no_grad()(name)` after the module's code, the same function for callers."""
    source = path.read_text()
    pattern = re.compile(r"^@torch\.no_grad\(\)\n(?=def (\w+)\()", flags=re.M)
    names = pattern.findall(source)
    if names:
        wraps = "".join(f"{name} = torch.no_grad()({name})\n" for name in names)
        path.write_text(pattern.sub("", source) + "\n\n" + wraps)


def mutmut(*args: str) -> list[str]:
    """The mutmut command of this interpreter's environment."""
    found = shutil.which("mutmut", path=str(Path(sys.executable).parent))
    return [found or "mutmut", *args]


def run_module(work: Path, minutes: float | None) -> tuple[int, bool]:
    """Run mutmut in `work`; (exit status, whether the time limit stopped it)."""
    env = dict(os.environ)
    # the mutated copy first, also for any subprocess a test starts (an editable install
    # of the project would otherwise supply the unmutated package there)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(work / "mutants" / "src"), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.setdefault("OMP_NUM_THREADS", "1")  # one torch thread per mutmut worker
    # made now: a PYTHONPATH folder missing at startup would be skipped for good
    (work / "mutants" / "src").mkdir(parents=True, exist_ok=True)
    workers = str(os.cpu_count() or 1)
    with open(work / "mutmut.log", "w") as log:
        proc = subprocess.Popen(
            mutmut("run", "--max-children", workers),
            cwd=work,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=None if minutes is None else minutes * 60), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)  # the results so far are saved per mutant
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return proc.returncode, True


def results(work: Path) -> dict[str, str]:
    """mutant name -> status, from `mutmut results --all true`."""
    out = subprocess.run(
        mutmut("results", "--all", "true"), cwd=work, capture_output=True, text=True, check=True
    ).stdout
    found = dict(re.findall(r"^\s+(\S+): (.+)$", out, flags=re.M))
    return {name: status.strip() for name, status in found.items()}


def summarise(statuses: dict[str, str]) -> Counter:
    counts = Counter(s if s in STATUSES else "other" for s in statuses.values())
    counts["mutants"] = len(statuses)
    return counts


def score(c: Counter) -> str:
    tested = c["mutants"] - c["no tests"] - c["not checked"]
    return f"{100 * (c['killed'] + c['timeout']) / tested:.1f}%" if tested else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("modules", nargs="*", help="substrings of the module paths to run")
    parser.add_argument("--minutes", type=float, help="time limit per module")
    parser.add_argument("--resume", action="store_true", help="continue the previous runs")
    parser.add_argument("--diffs", action="store_true", help="print each survivor's diff")
    parser.add_argument(
        "--report", action="store_true", help="only read back the results of earlier runs"
    )
    args = parser.parse_args()

    chosen = [m for m in MODULES if not args.modules or any(s in m for s in args.modules)]
    if not chosen:
        parser.error(f"no module matches {args.modules}; known: {', '.join(MODULES)}")
    chosen.sort(key=lambda m: len((ROOT / "src/mhsa" / m).read_text().splitlines()))

    rows, survivors, failed = [], [], []
    for module in chosen:
        work = workdir(module)
        print(f"== {module}: {work.relative_to(ROOT)}", flush=True)
        if args.report:
            if not (work / "mutants").is_dir():
                print("   no earlier run")
                continue
        else:
            prepare(module, tests_for(module), args.resume)
            start = time.monotonic()
            status, stopped = run_module(work, args.minutes)
            spent = work / "seconds"  # the time of this module's runs, resumed ones added
            before = float(spent.read_text()) if spent.exists() else 0.0
            spent.write_text(f"{before + time.monotonic() - start:.0f}\n")
            if status != 0 and not stopped:
                failed.append(module)
                print(f"   mutmut failed ({status}); its output is in {work / 'mutmut.log'}")
                continue
        try:
            statuses = results(work)
        except subprocess.CalledProcessError as error:
            failed.append(module)
            print(f"   mutmut results failed ({error.returncode}): {error.stderr.strip()}")
            continue
        counts = summarise(statuses)
        seconds = float((work / "seconds").read_text()) if (work / "seconds").exists() else 0
        rows.append((module, counts, seconds))
        survivors += [(work, name) for name, s in statuses.items() if s == "survived"]
        print(f"   {counts['mutants']} mutants, score {score(counts)}, {seconds:.0f} s", flush=True)

    header = (
        "module",
        "mutants",
        "killed",
        "survived",
        "timeout",
        "suspicious/other",
        "no tests",
        "not checked",
        "score",
        "time",
    )
    print("\n" + " | ".join(header))
    for module, c, seconds in rows:
        other = c["suspicious"] + c["other"]
        cells = [
            module,
            c["mutants"],
            c["killed"],
            c["survived"],
            c["timeout"],
            other,
            c["no tests"],
            c["not checked"],
            score(c),
            f"{seconds:.0f} s",
        ]
        print(" | ".join(map(str, cells)) + (" (partial)" if c["not checked"] else ""))
    print("score = (killed + timeout) / (mutants - no tests - not checked)")

    if survivors:
        print(f"\nsurvivors ({len(survivors)}):")
    for work, name in survivors:
        print(f"  {name}  [{work.relative_to(ROOT)}]")
        if args.diffs:
            shown = subprocess.run(mutmut("show", name), cwd=work, capture_output=True, text=True)
            print("    " + (shown.stdout or shown.stderr).strip().replace("\n", "\n    "))
    if failed:
        print(f"\nmutmut failed for: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
