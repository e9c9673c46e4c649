"""The `kvpool` command (kvpool.cli.main), entered through `main`."""

import signal


def main() -> None:
    """Run the command; a Ctrl-C while its modules load (about half a second) exits 130
    without a traceback. SIGUSR1 is ignored until a master or node takes it (it re-reads the
    token file then): its default ends the process, and an operator who signals every kvpool
    process of a host in a token rotation killed one that was starting (review helper-154)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        from kvpool.cli.main import app
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    app()
