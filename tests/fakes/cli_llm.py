"""A fake CLI LLM tool for the `cli` adapter tests: reads the prompt on stdin, writes words to
stdout one flush at a time, and can fail, hang, wait for a file, or leave a child behind.

    python tests/fakes/cli_llm.py --model NAME [--echo] [--words N] [--log FILE]
        [--hold-file F] [--pid-file F] [--hang] [--stderr TEXT] [--exit CODE] [--split-utf8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="")
    parser.add_argument("--echo", action="store_true", help="answer with the prompt itself")
    parser.add_argument("--words", type=int, default=3)
    parser.add_argument("--log", help="append a JSON line with what this run was given")
    parser.add_argument("--hold-file", help="wait for this file to exist before answering")
    parser.add_argument("--pid-file", help="start a child that sleeps, and write both pids here")
    parser.add_argument("--hang", action="store_true", help="write one word, then never end")
    parser.add_argument("--stderr", default="", help="write this to stderr")
    parser.add_argument("--exit", type=int, default=0)
    parser.add_argument("--split-utf8", action="store_true", help="write 'é' split over two flushes")
    args = parser.parse_args()

    prompt = sys.stdin.read()
    if args.log:
        with open(args.log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"model": args.model, "env_model": os.environ.get("IOP_MODEL"),
                                "request_id": os.environ.get("IOP_REQUEST_ID"), "prompt": prompt}) + "\n")
    if args.pid_file:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(args.pid_file + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {child.pid}")
        os.replace(args.pid_file + ".tmp", args.pid_file)
    if args.hold_file:
        while not os.path.exists(args.hold_file):
            time.sleep(0.01)
    out = sys.stdout.buffer
    if args.split_utf8:
        for part in (b"caf\xc3", b"\xa9!"):
            out.write(part)
            out.flush()
            time.sleep(0.05)
    elif args.echo:
        out.write(prompt.encode())
        out.flush()
    else:
        for i in range(args.words):
            out.write(f"w{i} ".encode())
            out.flush()
            if args.hang:
                time.sleep(600)
    if args.stderr:
        sys.stderr.write(args.stderr)
        sys.stderr.flush()
    return int(args.exit)


if __name__ == "__main__":
    sys.exit(main())
