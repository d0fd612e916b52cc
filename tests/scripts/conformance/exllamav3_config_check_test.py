#!/usr/bin/env python3
"""scripts/conformance/exllamav3_config_check.py on the model directories `exl3-tool
make-test-model` writes: exllamav3 1.6.5's own config reader (from its wheel in
../shared/exllamav3, torch stood in for) accepts the synthetic GLM-5.3-Flash in the release layout
(what scripts/gpu/glm5_next_model.sh writes for scripts/gpu/exllamav3_bench.sh) and finds every
weighted module's tensors, and the check refuses what exllamav3 refuses. Skipped without the wheel
or numpy.

    python3 exllamav3_config_check_test.py --exl3-tool PATH
"""
import argparse
import functools
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from contextlib import redirect_stdout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "scripts", "conformance"))
import exllamav3_config_check as check  # noqa: E402

TOOL = None  # exl3-tool, from --exl3-tool
# GLM-5.3-Flash's layout at a small shape (KDA heads of 128, as exllamav3's kernels take).
GLM5_NEXT = ["--arch", "glm5_next", "--synthetic", "--whole-model", "--hidden", "256", "--layers", "4",
             "--dense-layers", "1", "--dense-intermediate", "512", "--experts", "8", "--intermediate",
             "128", "--top-k", "2", "--shared", "1", "--vocab", "1024", "--heads", "4",
             "--q-lora-rank", "128", "--kv-lora-rank", "128", "--qk-nope-head-dim", "64",
             "--v-head-dim", "64", "--index-heads", "4", "--index-head-dim", "64", "--index-kpool", "4",
             "--index-topk", "64", "--linear-heads", "2", "--linear-head-dim", "128",
             "--bits", "2", "--codebook", "mcg", "--quiet"]


@functools.lru_cache(maxsize=None)
def exllamav3():
    """(Config, Model) or None where the check cannot run here."""
    try:
        with redirect_stdout(io.StringIO()):
            Config, Model, _ = check.import_exllamav3(None)
    except ImportError:
        return None
    return Config, Model


class Exllamav3ConfigCheckTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if exllamav3() is None:
            raise unittest.SkipTest("no exllamav3 wheel in ../shared/exllamav3 or no numpy")
        cls.tmp = tempfile.mkdtemp(prefix="exl3v3-config-check-")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def make(self, name, *extra):
        d = os.path.join(self.tmp, name)
        subprocess.run([TOOL, "make-test-model", *GLM5_NEXT, *extra, "--output", d], check=True,
                       timeout=120)
        return d

    def run_check(self, d):
        out = io.StringIO()
        with redirect_stdout(out):
            ok = check.check(d, ["text"], *exllamav3())
        return ok, out.getvalue()

    def test_release_layout_is_accepted(self):
        ok, out = self.run_check(self.make("release", "--release-layout"))
        self.assertTrue(ok, out)
        self.assertIn("accepted (Glm5NextConfig, 4 layers", out)

    def test_transformers_layout_is_refused_for_its_layer_names(self):
        # transformers' indexed_attention: exllamav3 reads only the release name.
        ok, out = self.run_check(self.make("transformers"))
        self.assertFalse(ok, out)
        self.assertIn("layer_types", out)

    def test_without_vision_config_is_refused(self):
        # What exllamav3 said of the synthetic model before config.json declared the vision tower.
        d = self.make("no-vision", "--release-layout")
        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
        del cfg["vision_config"]
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        ok, out = self.run_check(d)
        self.assertFalse(ok, out)
        self.assertIn("vision_config", out)

    def test_a_missing_layer_is_found(self):
        d = self.make("missing-layer", "--release-layout")
        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
        text = cfg["text_config"]
        text["num_hidden_layers"] = 5
        for key in ("layer_types", "mlp_layer_types", "indexer_types"):
            text[key].append(text[key][-1])
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        ok, out = self.run_check(d)
        self.assertFalse(ok, out)
        self.assertIn("model.language_model.layers.4.", out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--exl3-tool", required=True)
    args, rest = ap.parse_known_args()
    TOOL = args.exl3_tool
    unittest.main(argv=[sys.argv[0]] + rest)
