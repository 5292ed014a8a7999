#!/usr/bin/env python3
# tests/tools/test_lockstep_run.py: tools/lockstep-run's decisions, each over real mpiexec jobs
# of small shell programs that die, fail or succeed on chosen ranks and launches: a lost rank
# shrinks the job, --min and --max-restarts stop it, an error stops it at once, status 75
# relaunches at the same count, --slots gives the count back (and a bad --slots file is refused
# before the first launch), a rank's SIGABRT stops it like an error, SIGTERM to the launcher
# stops the job without a relaunch (and reaches each program once), a stop signal in the wait
# before a relaunch stops the launcher, one inherited as ignored stays ignored, a rank killed
# after a SIGUSR1 was passed on to it is lost, a reused --records directory's records are not
# read, the backoff neither overflows nor takes nan, a missing program is refused before
# mpiexec starts, and a lost launch script's children end with it. Every rank writes what it
# saw.
# Usage: test_lockstep_run.py <tools/lockstep-run> <mpiexec>
# SPDX-License-Identifier: Apache-2.0
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

LAUNCHER, MPIEXEC = sys.argv[1], sys.argv[2]

# What every rank of every launch runs: it records "<launch> <ranks> <rank>" in seen/, then
# behaves as $ACTION says for its launch and rank ("kill", "exit C" or nothing). A rank that
# mpiexec's clean-up ends early may record nothing.
RANK_PROGRAM = r'''
rank=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-$PMIX_RANK}}
seen="$SEEN/$LOCKSTEP_RUN_ATTEMPT.$rank"
echo "$LOCKSTEP_RUN_ATTEMPT $LOCKSTEP_RUN_REPLICAS $rank" > "$seen.tmp" && mv "$seen.tmp" "$seen"
action=$(sh -c "$ACTION" x "$LOCKSTEP_RUN_ATTEMPT" "$rank")
case "$action" in
  kill) kill -KILL $$ ;;
  abort) kill -ABRT $$ ;;
  exit*) exit ${action#exit } ;;
esac
exit 0
'''


# A Python rank program that writes its pid and its wrapper's to $SEEN/pid.<rank>, counts the
# signals it gets in $SEEN/<signal>.<rank> and keeps running for $RUN_FOR seconds in launch 0
# (SIGUSR1 is only counted; SIGTERM ends it 1 s later), then exits 0.
COUNTING_PROGRAM = r'''
import os, signal, sys, time
seen, rank = os.environ["SEEN"], os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
got, end = {}, [time.monotonic() + float(os.environ["RUN_FOR"])]
def write(name, text):
    with open(os.path.join(seen, name + ".tmp"), "w") as f:
        f.write(text)
    os.replace(os.path.join(seen, name + ".tmp"), os.path.join(seen, name))
def count(sig, _frame):
    got[sig] = got.get(sig, 0) + 1
    write(f"{signal.Signals(sig).name}.{rank}", str(got[sig]))
    if sig == signal.SIGTERM:
        end[0] = min(end[0], time.monotonic() + 1)
for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, count)
write(f"pid.{rank}", f"{os.getpid()} {os.getppid()}")
if os.environ["LOCKSTEP_RUN_ATTEMPT"] == "0":
    while time.monotonic() < end[0]:
        time.sleep(0.02)
'''


def ignoring(*signals):
    """A preexec_fn that starts the launcher with `signals` ignored, as nohup or a script's
    `cmd &` would."""
    return lambda: [signal.signal(s, signal.SIG_IGN) for s in signals] and None


class LockstepRun(unittest.TestCase):
    def run_job(self, n, action, *options):
        """Runs lockstep-run -n n over RANK_PROGRAM; `action` is a shell snippet given the launch
        ($1) and the rank ($2) that prints the rank's action. Returns (status, log, launches)
        where launches lists, per launch, its rank count as every rank saw it."""
        self.work = tempfile.mkdtemp(prefix="lockstep-run-test.")
        self.addCleanup(shutil.rmtree, self.work)
        seen = os.path.join(self.work, "seen")
        os.makedirs(seen)
        env = dict(os.environ, SEEN=seen, ACTION=action)
        proc = subprocess.run([sys.executable, LAUNCHER, "-n", str(n), "--backoff", "0.05",
                               "--mpiexec", MPIEXEC, *options, "--", "sh", "-c", RANK_PROGRAM],
                              env=env, capture_output=True, text=True, timeout=120)
        launches = {}
        for name in os.listdir(seen):
            if name.endswith(".tmp"):
                continue  # a rank that mpiexec's clean-up ended while it wrote
            with open(os.path.join(seen, name), encoding="ascii") as f:
                attempt, ranks, _rank = f.read().split()
            launches.setdefault(int(attempt), set()).add(int(ranks))
        counts = []
        for a in sorted(launches):
            self.assertEqual(len(launches[a]), 1, f"launch {a}: ranks saw {launches[a]}")
            counts.append(launches[a].pop())
        self.assertEqual(sorted(launches), list(range(len(counts))))
        return proc.returncode, proc.stderr, counts

    def test_success_is_one_launch(self):
        status, log, counts = self.run_job(3, "true")
        self.assertEqual((status, counts), (0, [3]), log)
        self.assertIn("launch 0 succeeded with 3 rank(s)", log)

    def test_lost_rank_relaunches_with_the_survivors(self):
        status, log, counts = self.run_job(3, 'if [ $1 = 0 ] && [ $2 = 1 ]; then echo kill; fi',
                                           "--min", "2")
        self.assertEqual((status, counts), (0, [3, 2]), log)
        self.assertIn("launch 0 lost rank 1 (SIGKILL)", log)
        self.assertIn("launch 1 succeeded with 2 rank(s)", log)

    def test_stops_below_min(self):
        status, log, counts = self.run_job(3, 'if [ $2 = 0 ]; then echo kill; fi', "--min", "2")
        self.assertNotEqual(status, 0)
        self.assertEqual(counts, [3, 2], log)
        self.assertIn("stopping: 1 rank(s) left, fewer than --min 2", log)

    def test_stops_after_max_restarts(self):
        status, log, counts = self.run_job(4, 'if [ $2 = 0 ]; then echo kill; fi',
                                           "--max-restarts", "1")
        self.assertNotEqual(status, 0)
        self.assertEqual(counts, [4, 3], log)
        self.assertIn("stopping: --max-restarts 1 relaunches made", log)

    def test_error_stops_at_once(self):
        status, log, counts = self.run_job(2, 'if [ $2 = 1 ]; then echo exit 3; fi')
        self.assertEqual((status, counts), (3, [2]), log)
        self.assertIn("rank 1 exit 3", log)
        self.assertIn("not relaunching", log)

    def test_abort_stops_at_once(self):
        # SIGABRT is the program's own abort (an uncaught exception), not a lost rank.
        status, log, counts = self.run_job(3, 'if [ $2 = 2 ]; then echo abort; fi', "--min", "1")
        self.assertNotEqual(status, 0)
        self.assertEqual(counts, [3], log)
        self.assertIn("rank 2 aborted (SIGABRT", log)
        self.assertNotIn("relaunching with", log)

    def test_try_again_relaunches_with_as_many(self):
        status, log, counts = self.run_job(2, 'if [ $1 = 0 ]; then echo exit 75; fi')
        self.assertEqual((status, counts), (0, [2, 2]), log)
        self.assertIn("relaunching with as many ranks", log)

    def test_slots_give_the_count_back(self):
        slots = tempfile.NamedTemporaryFile("w", suffix=".slots", delete=False)
        slots.write("3\n")
        slots.close()
        status, log, counts = self.run_job(3, 'if [ $1 = 0 ] && [ $2 = 2 ]; then echo kill; fi',
                                           "--slots", slots.name)
        os.unlink(slots.name)
        self.assertEqual((status, counts), (0, [3, 3]), log)
        self.assertIn("lost rank 2", log)

    def test_unreadable_slots_are_refused_before_the_first_launch(self):
        slots = tempfile.NamedTemporaryFile("w", suffix=".slots", delete=False)
        slots.write("abc\n")
        slots.close()
        self.addCleanup(os.unlink, slots.name)
        for path in (slots.name, slots.name + ".missing"):
            proc = subprocess.run([sys.executable, LAUNCHER, "-n", "2", "--slots", path, "--",
                                   "true"], capture_output=True, text=True, timeout=30)
            self.assertEqual(proc.returncode, 2, proc.stderr)
            self.assertIn(path, proc.stderr)
            self.assertNotIn("Traceback", proc.stderr)
            self.assertNotIn("launch 0", proc.stderr)

    def test_sigterm_stops_without_relaunch(self):
        work = tempfile.mkdtemp(prefix="lockstep-run-test.")
        self.addCleanup(shutil.rmtree, work)
        seen = os.path.join(work, "seen")
        os.makedirs(seen)
        env = dict(os.environ, SEEN=seen, ACTION="sleep 60")
        proc = subprocess.Popen([sys.executable, LAUNCHER, "-n", "2", "--backoff", "0.05",
                                 "--mpiexec", MPIEXEC, "--", "sh", "-c", RANK_PROGRAM],
                                env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while len([n for n in os.listdir(seen) if not n.endswith(".tmp")]) < 2:
            self.assertLess(time.monotonic(), deadline, "the ranks did not start")
            time.sleep(0.05)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, log = proc.communicate(timeout=30)
        self.assertLess(time.monotonic() - started, 20, log)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("stopped by SIGTERM: not relaunching", log)
        self.assertNotIn("launch 1", log)

    def start(self, n, program, env, *options, preexec_fn=None):
        """Starts lockstep-run in the background with its stderr in a file; returns (proc, path
        of the log, seen directory). TMPDIR is the test's, to check that nothing is left."""
        work = tempfile.mkdtemp(prefix="lockstep-run-test.")
        self.addCleanup(shutil.rmtree, work)
        seen, tmp = os.path.join(work, "seen"), os.path.join(work, "tmp")
        os.makedirs(seen)
        os.makedirs(tmp)
        log_path = os.path.join(work, "log")
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(
                [sys.executable, LAUNCHER, "-n", str(n), "--mpiexec", MPIEXEC, *options, "--",
                 *program], env=dict(os.environ, SEEN=seen, TMPDIR=tmp, **env),
                stdout=subprocess.DEVNULL, stderr=log_file, preexec_fn=preexec_fn)
        self.addCleanup(lambda: proc.poll() is None and proc.kill())
        return proc, log_path, seen

    def wait_started(self, seen, ranks=2):
        """Waits until ranks 0..ranks-1 wrote $SEEN/pid.<rank>; returns the files' paths."""
        pids = [os.path.join(seen, f"pid.{r}") for r in range(ranks)]
        self.wait_for("the ranks did not start", lambda: all(map(os.path.exists, pids)))
        return pids

    def wait_for(self, what, check, timeout=30):
        deadline = time.monotonic() + timeout
        while not check():
            self.assertLess(time.monotonic(), deadline, what)
            time.sleep(0.05)

    def read(self, path):
        with open(path, encoding="ascii") as f:
            return f.read()

    def finish(self, proc, log_path):
        proc.wait(timeout=60)
        return proc.returncode, self.read(log_path)

    def test_kill_after_a_passed_on_sigusr1_is_a_lost_rank(self):
        # The wrapper passed SIGUSR1 on and the program went on; SIGKILL (the OOM killer) later
        # makes the rank lost, not stopped.
        proc, log_path, seen = self.start(
            2, [sys.executable, "-c", COUNTING_PROGRAM], {"RUN_FOR": "30"}, "--backoff", "0.05")
        pids = self.wait_started(seen)
        program, wrapper = map(int, self.read(pids[1]).split())
        os.kill(wrapper, signal.SIGUSR1)
        self.wait_for("SIGUSR1 did not reach the program",
                      lambda: os.path.exists(os.path.join(seen, "SIGUSR1.1")))
        os.kill(program, signal.SIGKILL)
        status, log = self.finish(proc, log_path)
        self.assertEqual(status, 0, log)
        self.assertIn("launch 0 lost rank 1 (SIGKILL)", log)
        self.assertIn("launch 1 succeeded with 1 rank(s)", log)

    def test_summary_names_how_a_rank_ended(self):
        # A program that ends by the SIGUSR1 passed on to it was stopped, and the summary says so.
        proc, log_path, seen = self.start(
            2, ["sh", "-c", 'echo "$$ $PPID" > "$SEEN/pid.$PMI_RANK"; exec sleep 30'], {},
            "--backoff", "0.05")
        pid = os.path.join(seen, "pid.1")
        self.wait_for("the ranks did not start", lambda: os.path.exists(pid))
        os.kill(int(self.read(pid).split()[1]), signal.SIGUSR1)
        status, log = self.finish(proc, log_path)
        self.assertNotEqual(status, 0, log)
        self.assertIn("rank 1 stopped by SIGUSR1", log)
        self.assertNotIn("launch 1", log)

    def test_sigterm_reaches_each_program_once(self):
        proc, log_path, seen = self.start(
            2, [sys.executable, "-c", COUNTING_PROGRAM], {"RUN_FOR": "30"})
        self.wait_started(seen)
        proc.send_signal(signal.SIGTERM)
        status, log = self.finish(proc, log_path)
        self.assertIn("stopped by SIGTERM: not relaunching", log)
        for r in range(2):
            self.assertEqual(self.read(os.path.join(seen, f"SIGTERM.{r}")), "1", f"rank {r}")

    def lose_rank_1_then(self, sig, preexec_fn=None):
        """Launch 0 loses rank 1; `sig` reaches the launcher in the 10 s wait before the
        relaunch. Returns (status, log, temporary files left)."""
        proc, log_path, seen = self.start(
            2, ["sh", "-c", RANK_PROGRAM],
            {"ACTION": 'if [ $1 = 0 ] && [ $2 = 1 ]; then echo kill; fi'}, "--backoff", "10",
            preexec_fn=preexec_fn)
        self.wait_for("launch 0 did not fail", lambda: "relaunching" in self.read(log_path))
        started = time.monotonic()
        proc.send_signal(sig)
        status, log = self.finish(proc, log_path)
        if "launch 1" not in log:
            self.assertLess(time.monotonic() - started, 5, log)
        return status, log, os.listdir(os.path.join(os.path.dirname(seen), "tmp"))

    def test_stop_signal_in_the_backoff_stops_the_launcher(self):
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            with self.subTest(signal=sig.name):
                status, log, left = self.lose_rank_1_then(sig)
                self.assertEqual(status, 128 + sig, log)
                self.assertIn(f"stopped by {sig.name}: not relaunching", log)
                self.assertNotIn("launch 1", log)
                self.assertNotIn("Traceback", log)
                self.assertEqual(left, [], "the temporary records directory was left")

    def test_signals_inherited_as_ignored_stay_ignored(self):
        # nohup: SIGHUP neither stops a launch nor the wait before a relaunch.
        status, log, left = self.lose_rank_1_then(signal.SIGHUP, ignoring(signal.SIGHUP))
        self.assertEqual(status, 0, log)
        self.assertIn("launch 1 succeeded with 1 rank(s)", log)
        proc, log_path, seen = self.start(
            2, [sys.executable, "-c", COUNTING_PROGRAM], {"RUN_FOR": "3"},
            preexec_fn=ignoring(signal.SIGHUP, signal.SIGINT))
        self.wait_started(seen)
        proc.send_signal(signal.SIGHUP)
        proc.send_signal(signal.SIGINT)
        status, log = self.finish(proc, log_path)
        self.assertEqual(status, 0, log)
        self.assertIn("launch 0 succeeded with 2 rank(s)", log)

    def test_reused_records_are_not_read(self):
        # An earlier job's records in --records DIR: rank 2 (this job has 2 ranks) "lost", rank 1
        # "lost"; this job's rank 0 fails with an error, which must stop it at once.
        records = tempfile.mkdtemp(prefix="lockstep-run-test.")
        self.addCleanup(shutil.rmtree, records)
        os.makedirs(os.path.join(records, "attempt-0"))
        for r in (1, 2):
            with open(os.path.join(records, "attempt-0", f"rank-{r}"), "w") as f:
                f.write("signal 9\n")
        status, log, counts = self.run_job(2, 'if [ $2 = 0 ]; then echo exit 3; fi',
                                           "--records", records)
        self.assertEqual((status, counts), (3, [2]), log)
        self.assertIn("rank 0 exit 3", log)
        self.assertNotIn("lost rank", log)

    def test_backoff_neither_overflows_nor_takes_nan(self):
        work = tempfile.mkdtemp(prefix="lockstep-run-test.")
        self.addCleanup(shutil.rmtree, work)
        mpiexec = os.path.join(work, "mpiexec-75")
        with open(mpiexec, "w") as f:
            f.write("#!/bin/sh\nexit 75\n")
        os.chmod(mpiexec, 0o755)
        # 2 ** 1024 does not fit a float: relaunch 1025 must still wait (0 s here) and go on.
        proc = subprocess.run([sys.executable, LAUNCHER, "-n", "1", "--max-restarts", "1026",
                               "--backoff", "0", "--mpiexec", mpiexec, "--", "true"],
                              capture_output=True, text=True, timeout=240)
        self.assertEqual(proc.returncode, 75, proc.stderr[-2000:])
        self.assertNotIn("Traceback", proc.stderr)
        self.assertIn("launch 1026 ended with status 75", proc.stderr)
        self.assertIn("stopping: --max-restarts 1026 relaunches made", proc.stderr)
        for bad in ("nan", "inf", "-1"):
            proc = subprocess.run([sys.executable, LAUNCHER, "-n", "1", "--backoff", bad, "--",
                                   "true"], capture_output=True, text=True, timeout=30)
            self.assertEqual(proc.returncode, 2, bad)
            self.assertIn("--backoff", proc.stderr)

    def test_try_again_at_max_restarts_does_not_say_relaunching(self):
        status, log, counts = self.run_job(2, 'if [ $1 = 0 ]; then echo exit 75; fi',
                                           "--max-restarts", "0")
        self.assertEqual((status, counts), (75, [2]), log)
        self.assertIn("stopping: --max-restarts 0 relaunches made", log)
        self.assertNotIn("relaunching", log)

    def test_slots_of_zero_are_named(self):
        slots = tempfile.NamedTemporaryFile("w", suffix=".slots", delete=False)
        slots.write("0\n")
        slots.close()
        self.addCleanup(os.unlink, slots.name)
        status, log, counts = self.run_job(2, 'if [ $1 = 0 ] && [ $2 = 1 ]; then echo kill; fi',
                                           "--slots", slots.name)
        self.assertNotEqual(status, 0)
        self.assertEqual(counts, [2], log)
        self.assertIn(f"stopping: --slots {slots.name} says 0 rank(s), fewer than --min 1", log)

    def test_missing_program_is_refused_before_mpiexec(self):
        work = tempfile.mkdtemp(prefix="lockstep-run-test.")
        self.addCleanup(shutil.rmtree, work)
        not_executable = os.path.join(work, "not-executable")
        with open(not_executable, "w") as f:
            f.write("#!/bin/sh\nexit 0\n")
        for program, why in ((os.path.join(work, "missing"), "no such file"),
                             (not_executable, "not executable"),
                             ("lockstep-run-no-such-program", "not found on PATH")):
            proc = subprocess.run([sys.executable, LAUNCHER, "-n", "2", "--mpiexec", MPIEXEC,
                                   "--", program, "--flag"],
                                  capture_output=True, text=True, timeout=30)
            self.assertEqual(proc.returncode, 127, proc.stderr)
            self.assertIn(f"cannot run {program}: {why}", proc.stderr)
            self.assertNotIn("Traceback", proc.stderr)
            self.assertNotIn("launch 0", proc.stderr)

    def test_lost_launch_scripts_children_end_with_it(self):
        # Rank 1's program is a script whose work runs as its child; SIGKILL ends the script, and
        # its child must not keep the job (its output) open for 30 s.
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, LAUNCHER, "-n", "2", "--max-restarts", "0", "--mpiexec", MPIEXEC,
             "--", "sh", "-c", 'if [ "$PMI_RANK" = 1 ]; then (sleep 1; kill -KILL $$) & fi; '
             'sleep 30; exit 0'], capture_output=True, text=True, timeout=60)
        self.assertIn("launch 0 lost rank 1 (SIGKILL)", proc.stderr)
        self.assertLess(time.monotonic() - started, 15, proc.stderr)

    def test_missing_mpiexec(self):
        proc = subprocess.run([sys.executable, LAUNCHER, "-n", "2", "--mpiexec",
                               "/nonexistent/mpiexec", "--", "true"],
                              capture_output=True, text=True, timeout=30)
        self.assertEqual(proc.returncode, 127)
        self.assertIn("cannot start /nonexistent/mpiexec", proc.stderr)

    def test_refuses_bad_options(self):
        proc = subprocess.run([sys.executable, LAUNCHER, "-n", "2", "--min", "3", "--", "true"],
                              capture_output=True, text=True, timeout=30)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("--min 3", proc.stderr)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
