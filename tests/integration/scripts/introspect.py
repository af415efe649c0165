"""What a rank process sees of how it was started, as JSON on stdout: argv, __name__,
__file__, sys.path[0], the working directory, PROBE from the environment, whether
stdin is at its end, whether torch is imported yet. Then a line on stderr, and an
exit: `introspect.py CODE` exits CODE, `introspect.py raise` raises, `introspect.py
wait` waits for a signal."""

import json
import os
import signal
import sys

print(
    json.dumps(
        {
            "argv": sys.argv,
            "name": __name__,
            "file": __file__,
            "path0": sys.path[0],
            "cwd": os.getcwd(),
            "probe": os.environ.get("PROBE"),
            "stdin_at_end": sys.stdin.read() == "",
            "env_keys": sorted(os.environ),
        }
    )
)
print("to stderr", file=sys.stderr)
what = sys.argv[1] if len(sys.argv) > 1 else "0"
if what == "raise":
    raise RuntimeError("raised on purpose")
if what == "wait":
    print("waiting", flush=True)
    signal.pause()
sys.exit(int(what))
