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

    try:
        return run(argv)
    except SidecarError as exc:  # e.g. no sidecar at --address: one line that says what to do, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


raise SystemExit(main())
