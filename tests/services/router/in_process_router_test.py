"""InProcessRouter (the router's logic in an engine's process) over a real exl3-worker on loopback:
bad input answered in-band, a good request, a request withdrawn with CancelRequest while the
worker is paused, and Close. The probe binary is tests/services/router/in_process_probe.cc."""

import os
import signal
import subprocess
import unittest

from harness import BUILD, Cluster


PROBE = os.path.join(BUILD, "tests", "exl3-in-process-probe")


class InProcessRouterTest(unittest.TestCase):
    def setUp(self):
        """A fresh cluster per case (test model and map); the first case starts its worker."""
        self.c = Cluster()
        self.addCleanup(self.c.stop)
        self.c.write_map("workers:\n  - name: a\n    address: 127.0.0.1:{a}\n    experts: all\n")

    def test_bad_input_in_band_and_cancel(self):
        self.w = self.c.start_worker("a")
        p = subprocess.Popen([PROBE, self.c.model, self.c.map_path, "--cancel"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        lines = []
        try:
            while True:
                line = p.stdout.readline()
                if not line:
                    break
                lines.append(line.strip())
                if line.strip() == "paused?":
                    self.w.freeze()
                    p.stdin.write("\n")
                    p.stdin.flush()
            p.wait(timeout=60)
        finally:
            self.w.signal(signal.SIGCONT)
            if p.poll() is None:
                p.kill()
                p.wait()
        err = p.stderr.read()
        self.assertEqual(p.returncode, 0, "\n".join(lines) + err)
        got = dict(line.split(" ", 1) for line in lines if " " in line)
        self.assertEqual(got.get("bad_layer"), "NOT_FOUND", lines)
        self.assertEqual(got.get("bad_shape"), "INVALID_ARGUMENT", lines)
        self.assertEqual(got.get("good"), "OK", lines)
        self.assertEqual(got.get("routed"), "OK", lines)
        self.assertEqual(got.get("routed_bad"), "INVALID_ARGUMENT", lines)
        self.assertEqual(got.get("cancel"), "CANCELLED", lines)
        self.assertEqual(got.get("in_flight"), "0", lines)
        self.assertEqual(got.get("close"), "OK", lines)

    def test_no_serving_worker_fails_create(self):
        # A map whose only worker does not exist: Create waits (exl3-loadgen's
        # --ready-timeout-ms), then names the problem.
        d = self.c.dir
        bad = os.path.join(d, "dead-map.yaml")
        with open(bad, "w") as f:
            f.write("workers:\n  - name: a\n    address: 127.0.0.1:1\n    experts: all\n")
        p = subprocess.run([os.path.join(BUILD, "bin", "exl3-loadgen"), "--in-process-router",
                            "--expert-map", bad, "--model", self.c.model, "--requests", "1",
                            "--ready-timeout-ms", "500"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("experts have no serving worker", p.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
