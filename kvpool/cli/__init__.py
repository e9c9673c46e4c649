"""The `kvpool` command (kvpool.cli.main), entered through `main`."""


def main() -> None:
    """Run the command; a Ctrl-C while its modules load (about half a second) exits 130
    without a traceback."""
    try:
        from kvpool.cli.main import app
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    app()
