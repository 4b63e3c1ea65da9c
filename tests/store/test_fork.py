"""A process forked while another thread holds the run store's lock (a DataLoader worker forked
while a recording starts) can still open a run of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, sys, threading, time
    from trainguard.store import _shared, acquire_writer, release_writer

    held, done = threading.Event(), threading.Event()

    def hold():  # what acquire_writer does while it builds a writer
        with _shared._shared_lock:
            held.set()
            done.wait()

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        release_writer(acquire_writer(sys.argv[1]))
        os._exit(0)
    done.set()
    t.join()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done_pid, status = os.waitpid(pid, os.WNOHANG)
        if done_pid:
            sys.exit(os.waitstatus_to_exitcode(status))
        time.sleep(0.05)
    os.kill(pid, 9)
    print("the child hung in acquire_writer")
    sys.exit(5)
""")


def test_a_child_forked_while_the_store_lock_is_held_opens_its_own_run(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "child")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "child" / "run.sqlite").exists()
