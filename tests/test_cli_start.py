"""The command line answers at once: help, the version and argument errors import no torch (they took ~7 s when
every command's module, and torch with them, was imported to print help), and Ctrl-C while a command's modules
import is one line and exit 130, not a KeyboardInterrupt traceback."""
import subprocess
import sys

import pytest

from vitkit.cli.main import COMMANDS, main

ASKS = [["--help"], ["--version"], ["bogus"], *([c, "--help"] for c in COMMANDS), ["train", "--no-such-flag"],
        ["eval", "--batch-size", "0", "--checkpoint", "x"], ["train", "--workers", "-1"]]


def test_help_version_and_argument_errors_import_no_torch():
    code = ("import sys\nfrom vitkit.cli.main import main\nasks = " + repr(ASKS) + "\n"
            "for argv in asks:\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code in (0, 2), (argv, e.code)\n"
            "    else:\n        raise AssertionError(argv)\n"
            "    heavy = sorted(m for m in ('torch', 'torchvision', 'numpy', 'PIL') if m in sys.modules)\n"
            "    assert not heavy, (argv, heavy)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "usage: vitkit" in r.stdout and "vitkit 0.1.0" in r.stdout
    assert "unrecognized arguments: --no-such-flag" in r.stderr
    assert "expected a whole number of at least 1, got '0'" in r.stderr


@pytest.mark.parametrize("argv", [["train", "--epochs", "1"], ["eval", "--checkpoint", "x"], []])
def test_ctrl_c_while_a_commands_modules_import_is_one_line_and_exit_130(argv, monkeypatch, capsys):
    import importlib

    def interrupted(name, *a, **k):
        raise KeyboardInterrupt  # what Ctrl-C does in the first seconds: inside an import

    monkeypatch.setattr(importlib, "import_module", interrupted)
    if not argv:  # no command: the one place left where a module is imported is the run itself
        monkeypatch.setattr(sys, "argv", ["vitkit", "train"])
    assert main(argv or None) == 130
    err = capsys.readouterr().err.strip().splitlines()
    who = "vitkit " + (argv or ["train"])[0]
    assert err == [f"{who}: interrupted (nothing half-written: files and caches are written whole or not at all)"]


HOOK = """
import os, runpy, signal, sys
fired = []
class SendsCtrlC:  # an import that is about to run: Ctrl-C at that moment, sent by the process to itself
    def find_spec(self, name, path=None, target=None):
        if name == WHEN and not fired:
            fired.append(name)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, SendsCtrlC())
sys.argv = ["vitkit", "train", "--epochs", "1", "--output", OUT]
runpy.run_module("vitkit", run_name="__main__", alter_sys=True)
"""


def _vitkit_train(code: str, **popen):
    import signal

    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen)  # (a test
    # worker's processes may start with SIGINT ignored, as pytest-xdist's do: a shell's start with it on)


@pytest.mark.parametrize("when", ["vitkit.cli.main", "torch", "torch.distributed"])
def test_ctrl_c_during_start_up_ends_quietly_with_130(tmp_path, when):
    """A real SIGINT to `python -m vitkit train` at the moment a start-up import begins (an event, not a clock):
    importing vitkit's command line, torch, torch.distributed (where an exception raised inside torch's C++ import
    aborted the process with "terminate called after throwing ... pybind11::error_already_set"). Nothing had begun:
    exit 130, no traceback, no run folder, and one line (there was none: issue 81, U1)."""
    p = _vitkit_train(f"WHEN = {when!r}\nOUT = {str(tmp_path / 'x')!r}\n" + HOOK)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, (p.returncode, err[-2000:])
    assert "Traceback" not in err and "terminate called" not in err, err[-2000:]
    assert err.split() == "vitkit train: interrupted before it began (nothing was done)".split(), err[-2000:]
    assert not (tmp_path / "x").exists()


def test_a_ctrl_c_while_the_process_exits_ends_it_with_130_not_by_the_signal():
    """A SIGINT after the command returned, while the interpreter exits (a terminal's Ctrl-C passed on again):
    Python's own handler raised it into the shutdown, and the process died by SIGINT (exit -2; issue 81, C3)."""
    code = ("import os, signal, sys, time\nfrom vitkit.cli.main import main\nsys.argv = ['vitkit', 'models']\n"
            "rc = main()\nprint('returned', rc, flush=True)\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(2)\n"
            "sys.exit(rc)")
    p = _vitkit_train(code)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "returned 0" in out and "Traceback" not in err, (p.returncode, err[-2000:])


def test_ctrl_c_once_the_command_has_begun_is_one_line_and_130(tmp_path):
    """A real SIGINT once `vitkit train` has printed its first line (its work has begun: the event the test waits
    for): one line saying what was done, exit 130, never a traceback or an exit 0."""
    import signal

    p = _vitkit_train(f"import runpy, sys\nsys.argv = ['vitkit', 'train', '--epochs', '1', '--output', "
                      f"{str(tmp_path / 'x')!r}]\nrunpy.run_module('vitkit', run_name='__main__', alter_sys=True)")
    first = p.stdout.readline()  # the command is at work
    assert first, p.stderr.read()[-2000:]
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, (p.returncode, err[-2000:])
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) in (1, 2), err[-2000:]
    assert lines[0].startswith(("vitkit train: interrupted", "signal 2: finishing this step")), err[-2000:]


def test_the_cli_reference_has_every_command():
    """docs/reference/cli.md lacked `vitkit shard`: every command's help is generated there, and none is left out."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "cli.md").read_text()
    missing = [c for c in COMMANDS if f"<!-- cli-help: {c} -->" not in page]
    assert not missing, f"docs/reference/cli.md has no help for {missing}"
