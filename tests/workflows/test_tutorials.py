"""Every code block of the tutorials (docs/tutorials/) runs as written, and every console
sample in them matches what its command prints (issue 41; issue 39, item 6).

The tutorials build on each other (the resume tutorial continues the first run), so they run
in the order of the site's navigation (mkdocs.yml), in one fresh directory laid out like a
clone (``train.py`` and ``conf/`` linked in), their blocks in order, as a reader would type
them:

* a ``bash`` block runs with ``bash -e`` (``python`` is this interpreter);
* the ``python`` blocks of a tutorial run as one script (a reader continuing one script), in
  this process, in that directory: TensorFlow is imported once for the suite, not once more;
* a block after ``<!-- file: NAME -->`` is written to ``NAME``;
* a ``console`` block is a sample of the output of the ``bash`` block before it: each of its
  log lines (``[time][logger][LEVEL] - message``) must match a line the command printed, in
  order, with times, paths and figures free and every word fixed (the backend's name, the
  logger, the message). Keras's progress lines are left out (a terminal gets a progress bar,
  a pipe one line per epoch);
* a block after ``<!-- not run: REASON -->`` is skipped for that reason (installing the
  project: the test runs in the environment it is installed in).

The tutorials use the smallest settings that still show what they teach, so that all of them
together cost well under a minute of CPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.paths import ROOT
from tests.helpers.processes import subprocess_env

TUTORIALS = ROOT / "docs" / "tutorials"
HANG_GUARD = 600  # seconds; only against a hung child, never asserted as a duration
BLOCK = re.compile(r"(?:<!--(?P<marker>[^>]*)-->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```\n", re.S)
LOG_LINE = re.compile(r"^\[[^\]]+\]\[[\w.]+\]\[[A-Z]+\] - ")
TIMESTAMP = re.compile(r"^\\\[[^\]]+?\\\]")  # the escaped "[2026-... ,123]"
PATH = re.compile(r"(?:/|outputs/)\S*")
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def blocks(page: Path) -> list[tuple[str, str, str]]:
    """``(marker, language, body)`` of every fenced block of a page, in order."""
    found = []
    for match in BLOCK.finditer(page.read_text()):
        found.append(((match["marker"] or "").strip(), match["lang"], match["body"]))
    return found


def sample_pattern(line: str) -> re.Pattern:
    """A console sample's log line as a pattern: its time, paths and figures free."""
    parts = []
    position = 0
    for match in PATH.finditer(line):
        parts.append(_words(line[position : match.start()]))
        parts.append(r"\S+")
        position = match.end()
    parts.append(_words(line[position:]))
    return re.compile(TIMESTAMP.sub(r"\\[[^\\]]+\\]", "".join(parts)) + "$")


def _words(text: str) -> str:
    out, position = [], 0
    for match in NUMBER.finditer(text):
        out += [re.escape(text[position : match.start()]), r"\d+(?:\.\d+)?"]
        position = match.end()
    return "".join([*out, re.escape(text[position:])])


def check_sample(sample: str, printed: str, where: str) -> None:
    printed_lines = [line for line in printed.splitlines() if LOG_LINE.match(line)]
    wanted = [line for line in sample.splitlines() if LOG_LINE.match(line)]
    assert wanted, f"{where}: a console sample without a log line checks nothing"
    position = 0
    for line in wanted:
        pattern = sample_pattern(line)
        for index in range(position, len(printed_lines)):
            if pattern.match(printed_lines[index]):
                position = index + 1
                break
        else:
            raise AssertionError(
                f"{where}: the console sample line\n  {line}\nis not what the command printed "
                f"(after the lines already matched):\n" + "\n".join(printed_lines[position:])
            )


def run(command: list[str], cwd: Path, env: dict[str, str], where: str) -> str:
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=HANG_GUARD
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{where} failed (exit {done.returncode}):\n{output[-4000:]}"
    return output


def tutorial_env() -> dict[str, str]:
    env = subprocess_env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def tutorial_pages() -> list[str]:
    """The tutorials in the order of the site's navigation (mkdocs.yml), which is the order
    they build on each other; every page of docs/tutorials/ must be in it."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    section = next(entry["Tutorials"] for entry in nav if "Tutorials" in entry)
    pages = [Path(page).name for page in section]
    assert sorted(pages) == sorted(p.name for p in TUTORIALS.glob("*.md")), pages
    return pages


@pytest.mark.slow
def test_tutorials_run_as_written(tmp_path, monkeypatch):
    (tmp_path / "train.py").symlink_to(ROOT / "train.py")
    (tmp_path / "conf").symlink_to(ROOT / "conf")
    env = tutorial_env()
    for page in tutorial_pages():
        script, printed, ran = [], None, 0
        for number, (marker, lang, body) in enumerate(blocks(TUTORIALS / page), 1):
            where = f"{page}, block {number}"
            if marker.startswith("not run:"):
                continue
            if marker.startswith("file:"):
                (tmp_path / marker.split(":", 1)[1].strip()).write_text(body)
            elif lang == "bash":
                printed = run(["bash", "-e", "-c", body], tmp_path, env, where)
                ran += 1
            elif lang == "console":
                assert printed is not None, f"{where}: a console sample before any command"
                check_sample(body, printed, where)
            elif lang == "python":
                script.append(body)
            elif lang not in ("text", "toml", "yaml"):
                raise AssertionError(f"{where}: a ```{lang} block the test does not know")
        if script:
            monkeypatch.chdir(tmp_path)
            code = compile("\n".join(script), f"docs/tutorials/{page}", "exec")
            exec(code, {"__name__": "__tutorial__"})
            ran += 1
        assert ran, f"{page} has no block the test runs"


def test_console_samples_check_the_words_not_the_figures():
    """The matcher frees times, paths and figures and nothing else: the stale sample of
    issue 39 (``backend SavedModelBackend``) fails against what the run prints."""
    printed = (
        "[2026-11-29 11:36:20,461][trainer.training.loop][INFO] - Training resnet (10346 "
        "parameters) on 1438 examples, 5 steps/epoch, 2 epochs; backend "
        "AsyncBackend(SavedModelBackend()); no strategy (one device)\n"
        "[2026-11-29 11:36:46,261][trainer.checkpointing.manager][INFO] - Saved checkpoint "
        "/tmp/x/outputs/2026-11-29/11-36-18/checkpoints/step-00000005 (step 5) in 0.14s\n"
    )
    same = printed.replace("10346", "8970").replace("/tmp/x", "/home/me/trainer")
    check_sample(same, printed, "figures and paths changed")
    stale = printed.replace("AsyncBackend(SavedModelBackend())", "SavedModelBackend")
    with pytest.raises(AssertionError, match="is not what the command printed"):
        check_sample(stale, printed, "stale backend")
    old_logger = printed.replace("trainer.checkpointing.manager", "trainer.checkpointing")
    with pytest.raises(AssertionError, match="is not what the command printed"):
        check_sample(old_logger, printed, "old logger name")
