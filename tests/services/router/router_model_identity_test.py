"""The model fingerprint covers the weights (weights.digest.json, model/weight_digest.h): a worker on
a model with the same config and other weights is kept out of service with a message naming both
fingerprints, and a worker whose model file changed after it was written refuses to load, naming
the tensor. Real processes on loopback; run by ctest (EXL3_BUILD_DIR set)."""

import json
import os
import shutil
import struct
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
from harness import BUILD, Cluster, Proc, wait_for  # noqa: E402

from exl3serve.v1 import exl3serve_pb2 as pb  # noqa: E402
from exl3serve_client import MoeRouterClient  # noqa: E402

TEST_MODEL = os.path.join(BUILD, "tests", "exl3-test-model")


def flip_byte_of(model_dir, needle):
    """Flips one data byte of the first tensor whose name contains `needle`; returns its name."""
    for f in sorted(os.listdir(model_dir)):
        if not f.endswith(".safetensors"):
            continue
        path = os.path.join(model_dir, f)
        with open(path, "r+b") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
            for name, t in sorted(header.items()):
                if name == "__metadata__" or needle not in name:
                    continue
                at = 8 + n + t["data_offsets"][0]
                fh.seek(at)
                b = fh.read(1)
                fh.seek(at)
                fh.write(bytes([b[0] ^ 0x5A]))
                return name
    raise AssertionError(f"no tensor with {needle!r} in {model_dir}")


class ModelIdentityTest(unittest.TestCase):
    def test_other_weights_other_fingerprint(self):
        c = Cluster()
        self.addCleanup(c.stop)
        # Same config and tensor layout, other random weights.
        other = os.path.join(c.dir, "other-weights")
        subprocess.run([TEST_MODEL, other, "--seed", "2"], check=True)
        for n in ("a", "b"):
            c.start_worker(n)
        real_model, c.model = c.model, other
        c.start_worker("b2")  # b's replica, on the other weights
        c.model = real_model
        r = c.start_router()
        client = MoeRouterClient(r.address)
        self.addCleanup(client.close)
        wait_for(lambda: client.describe().state == pb.STATE_SERVING, 20, "router SERVING")
        m = r.wait_for_log(r"worker b2 .*model fingerprint ([0-9a-f]{32}) .*differs from the "
                           r"router's ([0-9a-f]{32})")
        self.assertNotEqual(m.group(1), m.group(2))
        self.assertEqual({w.name: w.up for w in client.describe().workers},
                         {"a": True, "b": True, "b2": False})

    def test_changed_weight_file_refused_at_load(self):
        c = Cluster()
        self.addCleanup(c.stop)
        changed = os.path.join(c.dir, "changed")
        shutil.copytree(c.model, changed)
        tensor = flip_byte_of(changed, ".experts.1.up_proj.trellis")  # held by worker a (0-3)
        w = Proc("worker-a-changed", [
            os.path.join(BUILD, "bin", "exl3-worker"), "--model", changed, "--expert-map",
            c.map_path, "--worker", "a", "--listen", f"127.0.0.1:{c.ports['a']}",
            "--metrics-listen", "127.0.0.1:0", "--progress=false", "--mlock=false",
            "--threads", "1"], c.dir)
        self.addCleanup(w.stop)
        w.p.wait(timeout=30)
        self.assertNotEqual(w.p.returncode, 0, w.text())
        self.assertIn(f"tensor '{tensor}'", w.text())
        self.assertIn("content digest", w.text())


if __name__ == "__main__":
    unittest.main(verbosity=2)
