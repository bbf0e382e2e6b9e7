"""``python -m vitkit``: a Ctrl-C from here on is noted, not raised, until the command's own handling takes over
(cli.main: the start-up ends quietly with 130, the work in one line)."""
import signal

_early: list = []
if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # (not where it is ignored: nohup)
    signal.signal(signal.SIGINT, lambda signum, frame: _early.append(signum))

from vitkit.cli.main import main  # noqa: E402 - after the handler: this import is the start-up's first part

raise SystemExit(main(early=_early if signal.getsignal(signal.SIGINT) is not signal.default_int_handler else None))
