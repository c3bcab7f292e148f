"""The `tierkv` command's entry point (`tierkv ...`, `python -m tierkv.cli ...`).

The commands live in `tierkv._cli_commands`, whose imports take torch and take a couple of
seconds. A Ctrl-C or SIGTERM in those seconds raised `KeyboardInterrupt` inside some import and
printed a traceback (or, for SIGTERM, left the exit status to the default action). Nothing is
set up yet then, so here the first signal ends the process at once, with the status a process
killed by it reports (128 + the signal) and nothing printed; the commands install their own
handlers (`tierkv._cli_signals`) before they set anything up.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType

#: the signals that end a command (`tierkv._cli_signals.SIGNALS`, which this module must not
#: import: it is the light one)
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _end_at_once(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is not threading.main_thread():  # no handler can be set
        from tierkv._cli_commands import main as run_command
    else:
        # the process's own handlers come back after the import: `main` may be called in a
        # process that goes on (a test), and the command installs its own before it sets up
        previous = {signum: signal.signal(signum, _end_at_once) for signum in _SIGNALS}
        try:
            from tierkv._cli_commands import main as run_command
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    return run_command(argv)


if __name__ == "__main__":
    sys.exit(main())
