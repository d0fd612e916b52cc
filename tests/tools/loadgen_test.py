"""exl3-loadgen: argument errors, the final counts line and exit status, failures against an
unreachable target, --echo-baseline's transport-floor table, and per-layer percentiles, against a
live exl3-router + exl3-worker on loopback."""

import os
import re
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../services/router"))
from harness import BIN, Cluster, free_port, wait_for  # noqa: E402

from exl3serve.v1 import exl3serve_pb2 as pb  # noqa: E402
from exl3serve_client import MoeRouterClient  # noqa: E402

LOADGEN = os.path.join(BIN, "exl3-loadgen")
FINAL = re.compile(r"^requests=(\d+) ok=(\d+) failed=(\d+) verified=(\d+) mismatched=(\d+)$", re.M)


def run(*args, timeout=60):
    return subprocess.run([LOADGEN, *args], capture_output=True, text=True, timeout=timeout)


class LoadgenTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.c = Cluster()
        cls.addClassCleanup(cls.c.stop)  # also when setUpClass fails
        cls.c.write_map("workers:\n  - name: a\n    address: 127.0.0.1:{a}\n    experts: all\n")
        cls.c.start_worker("a")
        cls.r = cls.c.start_router()
        cl = MoeRouterClient(cls.r.address)
        wait_for(lambda: cl.describe(timeout=2).state == pb.STATE_SERVING, 20, "router ready")
        cl.close()

    def test_bad_arguments(self):
        p = run("--target", self.r.address)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--model DIR is required", p.stderr)
        p = run("--model", self.c.model, "--dtype", "int8")
        self.assertEqual(p.returncode, 2)
        p = run("--model", self.c.model, "--layers", "0")
        self.assertEqual(p.returncode, 2)
        self.assertIn("not an MoE layer", p.stderr)
        p = run("--model", "/nonexistent")
        self.assertEqual(p.returncode, 2)

    def test_unreachable_target_fails(self):
        dead = f"127.0.0.1:{free_port()}"
        p = run("--target", dead, "--model", self.c.model, "--requests", "4")
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        m = FINAL.search(p.stdout)
        self.assertEqual(m.groups(), ("4", "0", "4", "0", "0"))
        self.assertTrue(p.stdout.rstrip().endswith(m.group(0)))  # the last line
        p = run("--target", dead, "--model", self.c.model, "--requests", "2", "--allow-failures")
        self.assertEqual(p.returncode, 0)

    def test_echo_baseline_and_table(self):
        p = run("--target", self.r.address, "--model", self.c.model, "--requests", "40",
                "--concurrency", "2", "--tokens", "8", "--echo-baseline", "--verify")
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        out = p.stdout
        self.assertEqual(FINAL.search(out).groups(), ("40", "40", "0", "40", "0"))
        for title in ("router", "echo"):
            self.assertIn(f"{title}: per-layer round trip (microseconds)", out)
        # One row per MoE layer (1 and 2) and "all", with p50 <= p90 <= p99.
        rows = re.findall(r"^\s+(\d+|all)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
        self.assertEqual([r[0] for r in rows], ["1", "2", "all", "1", "2", "all"])
        for r in rows:
            p50, p90, p99 = map(float, r[2:])
            self.assertTrue(0 < p50 <= p90 <= p99, r)
        self.assertIn("transport floor (2 echo round trips)", out)
        self.assertRegex(out, r"summary: router_p50_us=[\d.]+ .* echo_p50_us=[\d.]+")

    def test_in_process_router(self):
        # The router's logic in exl3-loadgen's process: whole decode steps verified against the
        # CPU reference, the per-layer table, and the floor of one echo round trip.
        p = run("--in-process-router", "--expert-map", self.c.map_path, "--model", self.c.model,
                "--requests", "40", "--concurrency", "2", "--tokens", "4", "--verify",
                "--echo-baseline")
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        out = p.stdout
        self.assertIn("in-process router over", out)
        self.assertEqual(FINAL.search(out).groups(), ("40", "40", "0", "40", "0"))
        rows = re.findall(r"^\s+(\d+|all)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
        self.assertEqual([r[0] for r in rows], ["1", "2", "all", "1", "2", "all"])
        self.assertIn("transport floor (1 echo round trip)", out)
        p = run("--in-process-router", "--model", self.c.model, "--requests", "1")
        self.assertEqual(p.returncode, 2)
        self.assertIn("--in-process-router needs --expert-map FILE", p.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
