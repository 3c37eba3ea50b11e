"""The `autofit` command's entry point, set up before the command line imports its modules (about half
a second): the signals that stop a command, and standard descriptors that exist.

Ctrl-C (SIGINT) while importing or reading flags is an interruption like any other: exit 130, no
traceback. SIGTERM (a plain kill, a job runner's timeout, a cancelled CI job), SIGHUP (the terminal
closed) and SIGQUIT stop a command as Ctrl-C does: the probe's process group stopped, the study kept,
the resume command printed where the terminal still takes it; never killed mid-write. A signal the
command was started with ignored (`nohup` ignores SIGHUP) stays ignored. SIGPIPE stays ignored, as
Python sets it: a reader that went away is a failed write (cli/streams.py), and the work goes on.
"""

from __future__ import annotations

import os
import signal
import sys

STOPS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
"""Signals that stop a command as Ctrl-C does (SIGINT raises KeyboardInterrupt already)."""


def stop_on_signals() -> None:
    """Each of STOPS raises KeyboardInterrupt, unless this process was started with it ignored."""
    for signum in STOPS:
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, signal.default_int_handler)


def open_standard_fds() -> None:
    """A descriptor 0, 1 or 2 that is closed (`autofit env >&-`) gets /dev/null, before a file the command
    opens takes its number and receives what is printed (Python has set sys.stdout to None, which
    cli/streams.py reports as a stream that is closed)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            devnull = os.open(os.devnull, os.O_RDWR)
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)


def main() -> int:
    open_standard_fds()
    stop_on_signals()
    try:
        from autofit.cli import main as cli_main

        code = cli_main()  # which says more of an interruption while a command runs
    except KeyboardInterrupt:
        _ignore_stops()  # said once: a second signal while it is said would end the process by SIGINT (-2)
        try:
            print("\nautofit: interrupted", file=sys.stderr)
        except OSError:  # a terminal that closed (SIGHUP): nowhere to say it
            pass
        code = 130
    # The command has ended: a signal from now on, while the interpreter shuts down (its threads, its atexit
    # handlers; Python puts the default actions back as it finalizes, except where a signal is ignored),
    # would only replace the command's exit code with the signal's (129, 143).
    _ignore_stops()
    return code


def _ignore_stops() -> None:
    for signum in (signal.SIGINT, *STOPS):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, signal.SIG_IGN)
