"""The `tierkv` command's entry point (`tierkv ...`, `python -m tierkv.cli ...`).

The commands live in `tierkv._cli_commands`, whose imports take torch and take a couple of
seconds. A Ctrl-C or SIGTERM in those seconds raised `KeyboardInterrupt` inside some import and
printed a traceback (or, for SIGTERM, left the exit status to the default action). Nothing is
set up yet then, so here the first signal ends the process at once, with the status a process
killed by it reports (128 + the signal) and nothing printed; the commands install their own
handlers (`tierkv._cli_signals`) before they set anything up.

At once means `os._exit`, not an exception: raised from the handler, a `SystemExit` lands in
whatever import runs, and inside a C extension's initialisation (numpy's, torch's) it came
out as an `ImportError` with a traceback, or was swallowed by an import that falls back on
failure, and the command went on to serve as if no signal had come (1 run in 3 with the
signal 0.3 s after the start, session 19).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

#: the signals that end a command (`tierkv._cli_signals.SIGNALS`, which this module must not
#: import: it is the light one)
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _end_at_once(signum: int, frame: FrameType | None) -> None:
    os._exit(128 + signum)  # nothing to flush or take down yet (the module docstring)


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is not threading.main_thread():  # no handler can be set
        from tierkv._cli_commands import main as run_command
    else:
        # until the command installs its own (`terminable`, which puts these back when it
        # ends), and the process's own once it returned: `main` may be called in a process
        # that goes on (a test). Put back right after the import, they left the default
        # action to a signal in the moment before the command's (a SIGINT's traceback)
        previous = {signum: signal.signal(signum, _end_at_once) for signum in _SIGNALS}
        try:
            from tierkv._cli_commands import main as run_command

            return run_command(argv)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    return run_command(argv)


if __name__ == "__main__":
    sys.exit(main())
