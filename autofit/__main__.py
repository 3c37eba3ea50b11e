"""`python -m autofit`: the command line (`_entry.main`), its exit code the process's.

An interrupted command (130) ends here with `os._exit`, once the interpreter's exit functions have run and the
standard streams are flushed. CPython (3.11 to 3.13) marks a KeyboardInterrupt that passed through code run by
`PyRun_String` (some extension modules run Python that way while they import) as unhandled, even where the
command caught it; a `-m` run then ends itself by SIGINT after finalizing (exit -2, not 130). `autofit` as an
installed script exits through another path, which does not look at that mark.
"""

import atexit
import os
import sys

from autofit._entry import main

code = main()
if code == 130:
    atexit._run_exitfuncs()  # what finalizing would run: logging's flush, ...
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # a closed terminal, a closed or absent stream
            pass
    os._exit(code)
raise SystemExit(code)
