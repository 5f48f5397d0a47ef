"""The documentation cannot drift from the behaviour.

- ``mkdocs build --strict`` passes with no warning (broken links, anchors, nav entries,
  docstrings mkdocstrings cannot render);
- every ```python block of the quickstart (docs/index.md) runs as a real 2-rank job and
  finishes cleanly (a block preceded by ``<!-- not-run -->`` is a fragment and is
  skipped); the quickstart's shell commands, run as written, print the log the page
  shows (numbers, paths and host names aside), and the CLI it names finds the run;
- every option of ``peerwatch.Config`` is in the configuration reference;
- a rule is cited by its name, never by its number, and every name cited is defined in
  docs/how-it-works.md; nothing cites the team's guides outside the repository;
- every example in examples/ runs as its header says, kept short through its
  environment knobs. tests/test_launchers.py runs the launchers with its own program
  (launcher_program.py), not these files, so they run here.

Every process started here inherits the ``PEERWATCH_TEST_ID`` of the autouse ``no_leaks``
fixture (conftest.py): whatever outlives its test is killed and fails it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from harness import free_port
from launcher_jobs import FOREIGN_ENV

import peerwatch.core.config

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"
PYTHON_DIR = str(Path(sys.executable).parent)
RUN_TIMEOUT_S = 60.0  # one quickstart block or one example, start to end
NOT_RUN = "<!-- not-run -->"

_FENCE = re.compile(r"^(?P<before>.*?)^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$", re.S | re.M)


def code_blocks(page: Path) -> List[Tuple[str, str, bool]]:
    """``(language, code, runnable)`` of every fenced block of ``page``, in order.

    A block is not runnable when the last non-blank line before it is ``<!-- not-run -->``.
    """
    text = page.read_text()
    blocks = []
    pos = 0
    while True:
        m = _FENCE.search(text, pos)
        if m is None:
            return blocks
        before = [line for line in m.group("before").splitlines() if line.strip()]
        runnable = not (before and before[-1].strip() == NOT_RUN)
        blocks.append((m.group("lang"), m.group("body"), runnable))
        pos = m.end()


def clean_env(tmp: Path, **extra: str) -> Dict[str, str]:
    """The test's environment without anything naming a job or a run directory; the
    venv's executables first on PATH; derived run directories under ``tmp/xdg``."""
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
    xdg = tmp / "xdg"
    xdg.mkdir(mode=0o700, exist_ok=True)
    env.update(
        PATH=PYTHON_DIR + os.pathsep + env.get("PATH", ""), XDG_RUNTIME_DIR=str(xdg), PYTHONUNBUFFERED="1",
        GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", NO_MKDOCS_2_WARNING="1",
    )
    env.update(extra)
    return env


def run(argv: List[str], env: Dict[str, str], cwd: Path, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run to the end; on timeout the process is left to ``no_leaks``, which kills it and says so."""
    try:
        return subprocess.run(argv, env=env, cwd=str(cwd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.output.decode(errors="replace") if isinstance(e.output, bytes) else (e.output or "")
        raise AssertionError(f"{' '.join(argv)} still running after {timeout:g}s:\n{out[-4000:]}") from None


def run_dirs(tmp: Path) -> List[Path]:
    base = tmp / "xdg" / "peerwatch"
    return sorted(p for p in base.glob("*") if (p / "ranks").is_dir()) if base.is_dir() else []


# -- (a) the site builds, strictly -------------------------------------------------------


def test_mkdocs_build_strict_has_no_warning(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    result = run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                  "--site-dir", str(tmp_path / "site")], clean_env(tmp_path), ROOT)
    warnings = [line for line in result.stdout.splitlines() if "WARNING" in line or "ERROR" in line]
    assert result.returncode == 0 and not warnings, result.stdout[-6000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("install", "watch", "beat", "paused", "Config", "PeerFailure", "ConfigError", "RunDirError"):
        assert f'id="peerwatch.{name}"' in api, f"the API reference lost peerwatch.{name}"


def test_every_option_is_in_the_configuration_reference() -> None:
    page = (DOCS / "configuration.md").read_text()
    for name, (env_var, _parse) in peerwatch.core.config._OPTIONS.items():
        assert f"| `{name}` | `{env_var}` |" in page, f"docs/configuration.md: no table row for {name} ({env_var})"


# -- rules are cited by name, and each name is defined in docs/how-it-works.md ---------------

RULES_PAGE = DOCS / "how-it-works.md"
_NUMBERED = re.compile(r"\brules?\s+\d+", re.I)  # a rule cited by its number in some list
# the team's guides, kept outside the repository, and their numbered invariants
_OUTSIDE = re.compile(r"\b(?:DESIGN|STYLE)\.md\b|\b(?i:invariants?)\s+\d+")
# (rule: NAME), "# rule: NAME", """Rule: NAME. ...""", (...; rule: NAME), (rules: A, B): a name is lowercase
_CITED = re.compile(r"""(?:^|[(;#"]|-- )\s*(?i:(rules?)): ([a-z][a-z' -]*(?:, [a-z][a-z' -]*)*)""", re.M)
_QUOTED = re.compile(r'\b(?i:rules?) ((?:"[a-z][^"\n]*"(?:,? and |, )?)+)')  # the rule "NAME"
_DEFINED = re.compile(r"^- \*\*([a-z][^*]*)\*\*", re.M)  # - **NAME**: what it says (lowercase first)


def _cited_in() -> List[Path]:
    """The files where rules are cited: the package, its tests, its docs."""
    return sorted([*(ROOT / "peerwatch").rglob("*.py"), *(ROOT / "peerwatch").rglob("*.c"),
                   *(ROOT / "tests").rglob("*.py"), *DOCS.rglob("*.md")])


def rule_names() -> List[str]:
    """The names of the rules docs/how-it-works.md defines, in order."""
    return [m.group(1).strip().lower() for m in _DEFINED.finditer(RULES_PAGE.read_text())]


def cited_rules(text: str) -> List[str]:
    """The rule names ``text`` cites (see ``_CITED``; and ``the rule "NAME"``). After ``rule:``
    one name, ended by any mark but a space, an apostrophe or a hyphen; after ``rules:``, names
    separated by commas."""
    names = [n.strip(" -") for m in _CITED.finditer(text)
             for n in (m.group(2).split(", ") if m.group(1).lower() == "rules" else m.group(2).split(", ")[:1])]
    names += [n for m in _QUOTED.finditer(text) for n in re.findall(r'"([^"]+)"', m.group(1))]
    return [n.lower() for n in names if n.strip()]


def test_rules_are_cited_by_name_never_by_number() -> None:
    """A rule is cited by its name; several lists of rules number theirs from 1, so a number
    alone says neither which list nor what the rule says. Nor does anything cite the team's
    guides, which are not in the repository."""
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in _cited_in()
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if _NUMBERED.search(line) or _OUTSIDE.search(line)]
    assert not found, "cite the rule by its name (docs/how-it-works.md):\n" + "\n".join(found)


def test_every_rule_cited_is_defined_in_how_it_works() -> None:
    defined = rule_names()
    assert len(defined) == len(set(defined)) >= 30, f"rule names defined twice, or too few: {defined}"
    missing = sorted({f"{path.relative_to(ROOT)}: {name!r}" for path in _cited_in()
                      for name in cited_rules(path.read_text(errors="replace")) if name not in defined})
    assert not missing, "cited, but not defined in docs/how-it-works.md (as '- **NAME**'):\n" + "\n".join(missing)


def test_the_citation_reader_reads_what_the_code_writes() -> None:
    text = ('x  # rule: who enforces\n"""Rule: busy or stuck. What"""\n(rules: the ack window, the blind enforcer)\n'
            '# -- rule: who reports ------\n(rule: a silent host is lost (shared-filesystem mode)\n'
            '(x; rule: the step order, below)\n    Rule: who stays, as a value.\n'
            'the rules "naming a straggler" and "clearing a straggler" below\nThe one rule: not a citation')
    assert cited_rules(text) == ["who enforces", "busy or stuck", "the ack window", "the blind enforcer",
                                 "who reports", "a silent host is lost", "the step order", "who stays",
                                 "naming a straggler", "clearing a straggler"]
    assert _NUMBERED.search("see rule" + "s 3 and 4") and _NUMBERED.search("Rule" + " 10 of the plan")
    assert not _NUMBERED.search("the rule table") and not _NUMBERED.search("rule: who stays")
    assert _OUTSIDE.search("Invariant" + " 6: a teardown ends") and not _OUTSIDE.search("an invariant of the run")


# -- (b) the quickstart is true ----------------------------------------------------------

QUICKSTART = DOCS / "index.md"
PYTHON_BLOCKS = [code for lang, code, runnable in code_blocks(QUICKSTART) if lang == "python" and runnable]


def test_the_quickstart_has_code_to_run() -> None:
    assert any("peerwatch.install()" in code for code in PYTHON_BLOCKS)
    assert any("peerwatch.watch()" in code for code in PYTHON_BLOCKS)


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_quickstart_python_block_runs_as_a_two_rank_job(index: int, tmp_path: Path, no_leaks: str) -> None:
    """Each block is the program of both ranks of a real job; both must finish cleanly:
    exit 0, a success marker each, no verdict."""
    program = tmp_path / f"block{index}.py"
    program.write_text(PYTHON_BLOCKS[index])
    run_dir = tmp_path / "run"
    procs = []
    for rank in range(2):
        env = clean_env(tmp_path, RANK=str(rank), WORLD_SIZE="2", PEERWATCH_DIR=str(run_dir))
        procs.append(subprocess.Popen([sys.executable, str(program)], env=env, cwd=str(tmp_path),
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=RUN_TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:
            raise AssertionError(f"block {index} still running after {RUN_TIMEOUT_S:g}s") from None
    shown = "\n".join(f"--- rank {r} ---\n{out}" for r, out in enumerate(outputs))
    assert [p.returncode for p in procs] == [0, 0], shown
    assert sorted(os.listdir(run_dir / "events")) == ["success-00000.json", "success-00001.json"], shown


def _normalized(line: str) -> str:
    """A log line with what differs from run to run (pids, hosts, paths, times) blanked.

    In a row of the report's rank table the stacks column is blanked too: whichever rank
    makes the verdict prints the summary, and when the failing rank itself wins the race,
    its peer has not dumped its stacks yet ("-", truthfully) when the table is printed.
    The step column is blanked in every row. A rank's step, when the table is printed,
    is the one its last heartbeat carried. That is "-" when no periodic heartbeat fell
    inside its training, and a step when the machine was slow enough for one to. A
    torn-down rank's final heartbeat may also come before or after the summary is
    printed. A fresh-clone run beside other work printed steps 6 and 20 where the page
    shows "-" for two torn-down ranks. The state and exit columns are still checked.
    """
    # Whether the failing rank's own code was seen yet when the table was printed depends
    # on which rank printed it: "(expected)" in a row is blanked, the legend line is not.
    line = re.sub(r"^(\s*\d+\s+\d+\s+\w+\s+.*\s)\S+$", r"\1STACKS", line)
    line = re.sub(r"^(\s*\d+\s+\d+\s+\w+\s+.*\s)(-|\d+)(\s+STACKS)$", r"\1STEP\3", line)
    line = re.sub(r"^(\s*\d+\s+\d+\s+\w+\s+\d+) \(expected\)", r"\1", line)
    line = re.sub(r"\(pid \d+ on [^)]*\)", "(pid N on HOST)", line)
    line = re.sub(r"\(pid \d+, [^)]*\)", "(pid N, HOST)", line)
    line = re.sub(r"/[^\s\"',]+", "PATH", line)
    line = re.sub(r"\d+", "N", line)
    return " ".join(line.split())


def _quickstart_commands() -> Tuple[str, str, str]:
    """(train.py, the shell commands that run it, the log the page shows)."""
    blocks = code_blocks(QUICKSTART)
    train = next(code for lang, code, _ in blocks if lang == "python" and code.startswith("# train.py"))
    i, shell = next((i, code) for i, (lang, code, _) in enumerate(blocks) if lang == "bash" and "python train.py" in code)
    lang, log, _ = blocks[i + 1]
    assert lang == "text", "the block after the quickstart's commands must be the log they print"
    return train, shell, log


def test_quickstart_commands_print_the_documented_log(tmp_path: Path, no_leaks: str) -> None:
    train, shell, documented = _quickstart_commands()
    (tmp_path / "train.py").write_text(train)
    result = run(["bash", "-c", shell], clean_env(tmp_path), tmp_path)
    actual = {_normalized(line) for line in result.stdout.splitlines()}
    missing = [line for line in documented.splitlines() if line.strip() and _normalized(line) not in actual]
    assert not missing, "lines of the quickstart's log that the commands no longer print:\n  " + "\n  ".join(
        missing) + f"\n--- what they printed ---\n{result.stdout[-6000:]}"

    # `peerwatch ls` finds the run; `peerwatch report DIR` prints the report again.
    (run_dir,) = run_dirs(tmp_path)
    env = clean_env(tmp_path)
    listed = run(["peerwatch", "ls"], env, tmp_path).stdout
    assert "failed" in listed and "rank 1 exception" in listed and str(run_dir) in listed, listed
    report = run(["peerwatch", "report", str(run_dir)], env, tmp_path).stdout
    assert "failed first: raised RuntimeError" in report, report
    verdict = json.loads((run_dir / "report.json").read_text())["verdict"]
    assert (verdict["rank"], verdict["cause"], verdict["exit_code"]) == (1, "exception", 1)


# -- (b2) every failure output the docs show is what the command prints ---------------------

OUTPUT = re.compile(r"^<!-- output: (?P<command>.+?) -->\n```text\n(?P<body>.*?)^```", re.S | re.M)
OUTPUT_TIMEOUT_S = 120.0


def output_blocks() -> List[Tuple[str, str, str]]:
    """``(page, command, shown output)`` of every block marked ``<!-- output: COMMAND -->``:
    the terminal output COMMAND prints, run from the repository's root (trimmed: every
    line shown must be printed; every line peerwatch prints must be shown)."""
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for m in OUTPUT.finditer(page.read_text()):
            found.append((page.name, m.group("command"), m.group("body")))
    return found


def test_the_docs_show_the_failure_outputs_of_lightning_and_torchrun() -> None:
    commands = [command for _, command, _ in output_blocks()]
    assert any("lightning_ddp.py" in c for c in commands) and any("torchrun " in c for c in commands), commands


@pytest.mark.torch
@pytest.mark.timeout(300)
@pytest.mark.parametrize("page,command,shown", output_blocks(), ids=[f"{p}:{c.split('python ')[-1][:40]}" for p, c, _ in
                                                                      output_blocks()])
def test_a_documented_output_is_what_its_command_prints(page: str, command: str, shown: str, tmp_path: Path,
                                                        no_leaks: str) -> None:
    """Pids, hosts, paths, numbers aside: each line the page shows is printed, and each
    line peerwatch prints (its messages and its summary) is on the page. A changed
    message fails here until the page shows what is printed now."""
    pytest.importorskip("torch")
    if "lightning" in command:
        pytest.importorskip("lightning")
    env = clean_env(tmp_path, MASTER_PORT=str(free_port()))
    result = run(["bash", "-c", command], env, ROOT, timeout=OUTPUT_TIMEOUT_S)
    printed = result.stdout.splitlines()
    actual = {_normalized(line) for line in printed}
    documented = {_normalized(line) for line in shown.splitlines() if line.strip()}
    missing = [line for line in shown.splitlines() if line.strip() and _normalized(line) not in actual]
    unshown = [line for line in printed if _ours(line) and _normalized(line) not in documented]
    assert not missing and not unshown, (
        f"docs/{page}, the output of `{command}`:\n"
        + "shown, not printed:\n  " + "\n  ".join(missing)
        + "\nprinted by peerwatch, not shown:\n  " + "\n  ".join(unshown)
        + f"\n--- what it printed ({len(printed)} lines) ---\n{result.stdout[-8000:]}"
    )


def _ours(line: str) -> bool:
    """A line of peerwatch's: a message, or a line of its summary block."""
    return line.startswith("peerwatch:") or bool(re.match(
        r"^  (cause: |failed at |rank +pid +state|report: |traceback of the failing rank|\s*\d+\s+\d+\s+\w+\s+\S+\s+\S+$)",
        line))


# -- (c) every example runs ----------------------------------------------------------------

FAST = {"FAIL_STEP": "3", "STEPS": "10"}  # fail early, and a run without a failure is short


def example_env(tmp: Path, **extra: str) -> Dict[str, str]:
    return clean_env(tmp, **FAST, **extra)


def verdicts(tmp: Path) -> List[dict]:
    found = []
    for run_dir in run_dirs(tmp):
        path = run_dir / "events" / "verdict.json"
        if path.exists():
            found.append(json.loads(path.read_text()))
    return found


def test_every_example_has_a_smoke_test() -> None:
    covered = {"lightning_ddp.py", "torchrun_ddp.py", "mp_spawn.py", "by_hand.sh", "demo.py"}
    assert {p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".sh")} == covered


@pytest.mark.torch
def test_example_demo(tmp_path: Path, no_leaks: str) -> None:
    """`./dev demo --failure kill`: 4 ranks, rank 2 SIGKILLed, everyone exits 137."""
    pytest.importorskip("torch")
    result = run([sys.executable, str(EXAMPLES / "demo.py"), "--failure", "kill"], clean_env(tmp_path), tmp_path)
    assert result.returncode == 0, result.stdout[-6000:]
    assert "demo: OK: the job was torn down" in result.stdout
    assert "peerwatch: rank 2 (pid" in result.stdout and "failed first: killed by SIGKILL" in result.stdout


@pytest.mark.torch
def test_example_lightning_ddp(tmp_path: Path, no_leaks: str) -> None:
    """Rank 1 SIGKILLed: rank 0 is its parent and reads the signal; every rank exits 137."""
    pytest.importorskip("lightning")
    env = example_env(tmp_path, DEVICES="2", MASTER_PORT=str(free_port()))
    result = run([sys.executable, str(EXAMPLES / "lightning_ddp.py")], env, tmp_path)
    assert result.returncode == 128 + signal.SIGKILL, result.stdout[-6000:]
    assert re.search(r"^peerwatch: rank 0 \(pid \d+ on .+\) stops with exit code 137: rank 1 \(pid \d+ on .+\) "
                     r"failed first \(killed by SIGKILL\)$", result.stdout, re.M), result.stdout[-6000:]
    assert [(v["rank"], v["cause"], v["signal"]) for v in verdicts(tmp_path)] == [(1, "signal", "SIGKILL")]


@pytest.mark.torch
def test_example_torchrun_ddp(tmp_path: Path, no_leaks: str) -> None:
    """Worker 1 SIGKILLed: torchrun exits 1 and names it as the root cause."""
    pytest.importorskip("torch")
    torchrun = shutil.which("torchrun", path=PYTHON_DIR)
    assert torchrun is not None
    env = example_env(tmp_path, FAIL_RANK="1")
    result = run([torchrun, "--standalone", "--nproc-per-node", "2", str(EXAMPLES / "torchrun_ddp.py")], env, tmp_path)
    out = result.stdout
    assert result.returncode == 1, out[-6000:]
    root_cause = out[out.find("Root Cause"):]
    assert "Root Cause" in out and re.search(r"rank\s*:\s*1\b", root_cause) and "SIGKILL" in root_cause, out[-6000:]


@pytest.mark.torch
def test_example_mp_spawn(tmp_path: Path, no_leaks: str) -> None:
    """Worker 1 SIGKILLed: mp.spawn's main process names it and exits 1."""
    pytest.importorskip("torch")
    env = example_env(tmp_path, WORLD="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    result = run([sys.executable, str(EXAMPLES / "mp_spawn.py")], env, tmp_path)
    assert result.returncode == 1, result.stdout[-6000:]
    assert "process 1 terminated with signal SIGKILL" in result.stdout, result.stdout[-6000:]


@pytest.mark.torch
def test_example_by_hand(tmp_path: Path, no_leaks: str) -> None:
    """Rank 1 SIGKILLed: its shell alone knows how; rank 0 exits with the documented 1."""
    pytest.importorskip("torch")
    env = example_env(tmp_path, WORLD="2", FAIL_RANK="1", PYTHON=sys.executable, MASTER_PORT=str(free_port()))
    result = run(["bash", str(EXAMPLES / "by_hand.sh")], env, tmp_path)
    out = result.stdout
    assert "by_hand.sh: rank 0 exited with code 1" in out, out[-6000:]
    assert "by_hand.sh: rank 1 exited with code 137" in out, out[-6000:]
    assert result.returncode == 1, out[-6000:]
    assert [(v["rank"], v["cause"]) for v in verdicts(tmp_path)] == [(1, "vanished")]
