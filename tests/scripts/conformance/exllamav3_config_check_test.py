#!/usr/bin/env python3
"""scripts/conformance/exllamav3_config_check.py on the model directories `exl3-tool
make-test-model` writes: exllamav3 1.6.5's own config reader (from its wheel in
../shared/exllamav3, torch stood in for) accepts the synthetic GLM-5.3-Flash in the release layout
(what scripts/gpu/glm5_next_model.sh writes for scripts/gpu/exllamav3_bench.sh), the synthetic
Qwen3.8-Flash-Next in the release layout with its MTP head (scripts/gpu/qwen4_exp_model.sh's) and the
qwen4_exp_release_all fixture and finds every weighted module's tensors, and the check refuses what
exllamav3 refuses (Qwen3.8-Flash-Next: transformers' layer names, n-gram rows other than 160, widths
its Linear pads where the consumer does not trim, missing table pieces and module-read tensors).
Skipped without the wheel or numpy.

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

# Qwen3.8-Flash-Next's layout at a small shape exllamav3 takes: n-gram rows of 160 (4 heads, 640),
# a 128-wide index head, k/v_proj 128 wide (2 KV heads of 64).
QWEN4_EXP = ["--arch", "qwen4_exp", "--synthetic", "--whole-model", "--hidden", "256", "--layers", "2",
             "--experts", "8", "--intermediate", "128", "--top-k", "2", "--vocab", "1024", "--heads", "4",
             "--heads-per-ngram", "2", "--ple-embed-dim", "640", "--ngram-vocab-size-base", "300",
             "--index-heads", "2", "--index-head-dim", "128", "--index-kpool", "4", "--index-topk", "64",
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

    def rename_tensors(self, d, renames):
        """Renames tensors in the headers of the directory's shards (data untouched) and its
        index, as if the writer had stored them under those names."""
        left = dict(renames)
        for name in sorted(os.listdir(d)):
            if not name.endswith(".safetensors"):
                continue
            path = os.path.join(d, name)
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
                data = f.read()
            mine = {old: new for old, new in left.items() if old in header}
            if not mine:
                continue
            for old, new in mine.items():
                header[new] = header.pop(old)
                del left[old]
            raw = json.dumps(header).encode()
            raw += b" " * (-len(raw) % 8)
            with open(path, "wb") as f:
                f.write(len(raw).to_bytes(8, "little") + raw + data)
        self.assertEqual(left, {}, "tensors not found to rename")
        index = os.path.join(d, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                j = json.load(f)
            for old, new in renames.items():
                if old in j["weight_map"]:
                    j["weight_map"][new] = j["weight_map"].pop(old)
            with open(index, "w") as f:
                json.dump(j, f)

    def test_layouts_exllamav3_does_not_load_are_found(self):
        # What exllamav3's model.load() refused in exl3-tool quantize's earlier layouts (issue 34):
        # KDA's q/k/v as separate EXL3 layers (its Linear gets the list and fails), an EXL3
        # kv_b_proj (MLA reads only its .weight).
        d = self.make("layouts", "--release-layout")
        names = set(check.tensor_shapes(d))
        a = "model.language_model.layers.0.self_attn."
        m = next(n for n in sorted(names) if n.endswith("self_attn.kv_b_proj.weight"))[: -len("kv_b_proj.weight")]
        self.assertIn(f"{a}qkv_proj.trellis", names)
        qkv = {f"{a}qkv_proj.{t}": f"{a}q_proj.{t}" for t in ("trellis", "suh", "svh", "mcg")}
        self.rename_tensors(d, {**qkv, f"{m}kv_b_proj.weight": f"{m}kv_b_proj.trellis"})
        ok, out = self.run_check(d)
        self.assertFalse(ok, out)
        self.assertIn(f"No tensors found for {a}qkv_proj", out)
        self.assertIn(f"Required tensor {m}kv_b_proj.weight not found ({m}kv_b_proj.trellis is stored", out)

    def edited_copy(self, name, fixture, edit=None, copy=False):
        """A copy of tests/fixtures/engine/`fixture` (weights linked, or copied where the test renames
        tensors) whose config.json's text_config gets `edit`."""
        src = os.path.join(ROOT, "tests", "fixtures", "engine", fixture)
        d = os.path.join(self.tmp, name)
        os.makedirs(d)
        for f in os.listdir(src):
            if f != "config.json":
                (shutil.copy if copy else os.symlink)(os.path.join(src, f), os.path.join(d, f))
        with open(os.path.join(src, "config.json")) as f:
            cfg = json.load(f)
        if edit:
            edit(cfg["text_config"])
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        return d

    def test_synthetic_qwen4_exp_release_layout_is_accepted(self):
        d = os.path.join(self.tmp, "qwen4-synthetic")
        subprocess.run([TOOL, "make-test-model", *QWEN4_EXP, "--release-layout", "--mtp", "--output", d],
                       check=True, timeout=120)
        out = io.StringIO()
        with redirect_stdout(out):
            ok = check.check(d, ["text", "mtp"], *exllamav3())
        self.assertTrue(ok, out.getvalue())
        self.assertIn("accepted (Qwen4ExpConfig, 2 layers", out.getvalue())
        self.assertIn("mtp: ", out.getvalue())
        # transformers' layer name (without --release-layout): exllamav3 reads only full_attention.
        d = os.path.join(self.tmp, "qwen4-synthetic-transformers")
        subprocess.run([TOOL, "make-test-model", *QWEN4_EXP, "--output", d], check=True, timeout=120)
        ok, out = self.run_check(d)
        self.assertFalse(ok, out)
        self.assertIn("indexed_attention", out)

    def test_qwen4_exp_release_twin_is_accepted(self):
        ok, out = self.run_check(os.path.join(ROOT, "tests", "fixtures", "engine", "qwen4_exp_release_all"))
        self.assertTrue(ok, out)
        self.assertIn("accepted (Qwen4ExpConfig, 2 layers", out)

    def test_qwen4_exp_base_fixture_is_refused(self):
        # transformers' indexed_attention; with the release name, the n-gram rows of 32.
        ok, out = self.run_check(os.path.join(ROOT, "tests", "fixtures", "engine", "qwen4_exp_all"))
        self.assertFalse(ok, out)
        self.assertIn("indexed_attention", out)
        d = self.edited_copy("qwen4-base-renamed", "qwen4_exp_all", lambda t: t.update(
            layer_types=["full_attention" if x == "indexed_attention" else x for x in t["layer_types"]]))
        ok, out = self.run_check(d)
        self.assertFalse(ok, out)
        self.assertIn("expected 160-D embedding rows, got 32", out)

    def test_qwen4_exp_widths_exllamav3_pads_are_found(self):
        # 2 n-gram heads of 160 (ple_embed_dim 320) and an indexer of 8 x 32 + 32 = 288 outputs: its
        # Linear pads both to 384, which the PLE's fused matmul and the indexer's split do not take.
        def edit(t):
            t.update(ple_embed_dim=320, heads_per_ngram=1, indexer_head_dim=32)
        ok, out = self.run_check(self.edited_copy("qwen4-padded", "qwen4_exp_release_all", edit))
        self.assertFalse(ok, out)
        self.assertIn("ple.key_proj: ple_embed_dim 320 is padded to 384", out)
        self.assertIn("index_qk_proj: (indexer_n_heads + indexer_kv_heads) * indexer_head_dim = 288 is "
                      "padded to 384", out)

    def test_qwen4_exp_missing_tensors_are_found(self):
        # The n-gram table, its hashing constants, the PLE conv and a gated-residual site's weights
        # are read by the modules themselves (no Linear): each is looked for.
        d = self.edited_copy("qwen4-missing", "qwen4_exp_release_all", copy=True)
        t = "model.language_model."
        ple = t + "layers.0.ple."
        self.rename_tensors(d, {
            ple + "ple_embedding.ngram_embedding.shard_0.weight": ple + "ple_embedding.ngram_embedding.piece_0.weight",
            ple + "ple_embedding.ngram_heads_offsets": ple + "ple_embedding.offsets",
            ple + "conv1d.weight": ple + "conv.weight",
            t + "hyper_connection_mixer.hc_norm.weight": t + "hyper_connection_mixer.norm.weight"})
        ok, out = self.run_check(d)
        self.assertFalse(ok, out)
        self.assertIn(f"No .trellis, .weight or .shard_N.weight tensors found for {ple}ple_embedding.ngram_embedding", out)
        self.assertIn(f"Required tensor {ple}conv1d.weight not found", out)
        self.assertIn(f"Required tensor {t}hyper_connection_mixer.hc_norm.weight not found", out)
        # With the table back, the missing hashing constants show.
        self.rename_tensors(d, {ple + "ple_embedding.ngram_embedding.piece_0.weight":
                                ple + "ple_embedding.ngram_embedding.shard_0.weight"})
        ok, out = self.run_check(d)
        self.assertFalse(ok, out)
        self.assertIn(f"Required tensor {ple}ple_embedding.ngram_heads_offsets not found", out)

    def test_exllamav3s_own_conversion_is_accepted(self):
        d = os.path.join(ROOT, "tests", "fixtures", "exllamav3", "glm5_next_b4")
        ok, out = self.run_check(d)
        self.assertTrue(ok, out)
        self.assertIn("every one's tensors found as exllamav3 loads them", out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--exl3-tool", required=True)
    args, rest = ap.parse_known_args()
    TOOL = args.exl3_tool
    unittest.main(argv=[sys.argv[0]] + rest)
