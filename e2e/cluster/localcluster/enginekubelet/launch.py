"""Starts one engine so that it cannot outlive the engine kubelet: `python launch.py PARENT_PID -- ARGV...`.

Asks Linux to SIGKILL this process when its parent dies (PR_SET_PDEATHSIG, kept across exec), checks the parent
did not die before that, then becomes ARGV (same pid). Run by path, so it needs nothing on sys.path.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main() -> None:
    parent, sep, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    if sep != "--" or not argv:
        sys.exit("usage: launch.py PARENT_PID -- ARGV...")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        sys.exit(f"launch.py: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
    if os.getppid() != int(parent):
        sys.exit("launch.py: the engine kubelet is gone; not starting")
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
