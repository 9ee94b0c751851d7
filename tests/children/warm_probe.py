"""What a child process sees of itself, for the tests of the warm launcher
(``tests/helpers/warm.py``): ``python warm_probe.py OUT MODE [ARGS]`` writes OUT/seen.json
(argv, cwd, sys.path, environment, stdio buffering, the hash seed flag, ``__name__``), then
ends as MODE says, so that a warm (forked) child and a real one can be compared.

MODE: ``exit N`` (``sys.exit(N)``), ``raise`` (an uncaught ValueError), ``message``
(``sys.exit("a message")``), ``wait`` (print ``waiting`` and sleep until a signal).
Either way a non-daemon thread writes OUT/thread after the main code ended and an atexit
handler writes OUT/atexit: what a real interpreter does at exit.
"""

import atexit
import json
import os
import sys
import threading
import time
from pathlib import Path

out = Path(sys.argv[1])
mode = sys.argv[2]
seen = {
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "path": sys.path,
    "env": {k: v for k, v in os.environ.items() if k.startswith("WARM_PROBE")},
    "name": __name__,
    "stdout_line_buffering": sys.stdout.line_buffering,
    "stderr_line_buffering": sys.stderr.line_buffering,
    "hash_randomization": sys.flags.hash_randomization,
    "pythonhashseed": os.environ.get("PYTHONHASHSEED"),
}
(out / "seen.json").write_text(json.dumps(seen))
atexit.register(lambda: (out / "atexit").write_text("ran\n"))


def late() -> None:
    time.sleep(0.2)  # still running when the main code has ended
    (out / "thread").write_text("joined\n")


threading.Thread(target=late).start()
print("started", flush=True)
if mode == "exit":
    sys.exit(int(sys.argv[3]))
if mode == "message":
    sys.exit("a message")
if mode == "raise":
    raise ValueError("raised by the probe")
if mode == "wait":
    print("waiting", flush=True)
    time.sleep(600)
