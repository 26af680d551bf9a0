import sys

COMMANDS = ("demo", "bench", "fidelity", "profile")
USAGE = f"usage: python -m code2wav.loadgen {{{','.join(COMMANDS)}}} [options]"


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        return 2
    command, argv = sys.argv[1], sys.argv[2:]
    if command == "demo":
        from .demo import main as run
    elif command == "fidelity":
        from .fidelity import main as run
    elif command == "profile":
        from .profile import main as run
    else:
        from .bench import main as run
    from code2wav.client.errors import SidecarError
    from code2wav.sidecar.cli_checks import EXIT_INTERNAL, EXIT_USAGE, fail, run_guarded

    from .spawn import SpawnFailed

    def body() -> int:
        try:
            return run(argv)
        except SidecarError as exc:  # e.g. no sidecar at --address: one line that says what to do, not a traceback
            return fail(str(exc))
        except SpawnFailed as exc:  # the spawned sidecar's own one-line error, and where its log is
            fail(str(exc))
            return EXIT_USAGE if exc.returncode == EXIT_USAGE else EXIT_INTERNAL

    return run_guarded(command, body)


raise SystemExit(main())
