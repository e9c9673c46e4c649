"""The `kvpool` command (kvpool.cli.main), entered through `main`."""

import signal


def ignore_sigusr1_until_served() -> None:
    """SIGUSR1 ignored until a master or node takes it (it re-reads the token file then): its
    default ends the process, and an operator who signals every kvpool process of a host in a
    token rotation killed one still loading its modules (reviews helper-154, helper-156). The
    first thing a kvpool command does, by either entry."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def main() -> None:
    """Run the command; a Ctrl-C while its modules load (about half a second) exits 130
    without a traceback."""
    ignore_sigusr1_until_served()
    try:
        from kvpool.cli.main import app
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    app()
