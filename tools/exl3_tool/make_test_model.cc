// exl3-tool make-test-model: small MoE models with random weights in a family's real layout,
// as a Hugging Face checkpoint and converted to EXL3, or synthetic EXL3 models at any size.
#include <cstdio>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/codebook.h"
#include "model/encoder/checkpoint_converter.h"
#include "tools/test_model/resolve_test_model_spec.h"
#include "tools/test_model/test_model.h"
#include "tools/exl3_tool/subcommand.h"
#include "tools/exl3_tool/tool_util.h"

namespace exl3::tool {
namespace {

constexpr char kUsage[] =
    "usage: exl3-tool make-test-model\n"
    "         --arch glm4_moe|deepseek_v3|qwen3_moe|mixtral|glm_moe_dsa|deepseek_v4|qwen3_next|glm5_next|\n"
    "                qwen4_exp\n"
    "         --output DIR\n"
    "         [--layers N] [--hidden H] [--experts E] [--top-k K] [--intermediate I]\n"
    "         [--shared S] [--dense-layers D] [--dense-intermediate I2] [--n-group G]\n"
    "         [--topk-group G2] [--routed-scaling-factor F] [--swiglu-limit L] [--vocab V]\n"
    "         [--max-position N]\n"
    "         [--bits K] [--expert-bits K] [--down-bits K] [--codebook 3inst|mcg|mul1]\n"
    "         [--quantize-all [--head-bits K]] [--attention-bits K] [--seed S] [--threads N] [--hf-only]\n"
    "         [--hf-output DIR2] [--synthetic [--whole-model] [--misaligned-data]\n"
    "         [--expert-bits-cycle K1,K2,...] [--expert-codebook-cycle CB1,CB2,...]] [--quiet] [--mtp]\n"
    "         [--heads N] [--kv-heads N] [--head-dim D] [--q-lora-rank R] [--kv-lora-rank R]\n"
    "         [--qk-nope-head-dim D] [--qk-rope-head-dim D] [--v-head-dim D]\n"
    "         [--index-heads N] [--index-head-dim D] [--index-topk K]\n"
    "         [--layer-types T1,T2,...] [--sliding-window W] [--csa-compress-rate M]\n"
    "         [--hca-compress-rate M] [--o-groups G] [--o-lora-rank R] [--hc-mult N]\n"
    "         [--hc-sinkhorn-iters N] [--hash-layers N]\n"
    "         [--linear-key-heads N] [--linear-value-heads N] [--linear-key-head-dim D]\n"
    "         [--linear-value-head-dim D] [--linear-conv-kernel K] [--full-attention-interval N]\n"
    "         [--linear-heads N] [--linear-head-dim D] [--index-kpool P] [--release-layout]\n"
    "         [--hc-lowrank R] [--ple-layer-ids L1,L2,...] [--ple-embed-dim E] [--ple-conv-kernel K]\n"
    "         [--ngram-size N] [--heads-per-ngram N] [--ngram-vocab-size-base V] [--split-ngram-parts P]\n"
    "\n"
    "Writes a MoE model with random weights in the family's real tensor names and config.json\n"
    "(router weight, e_score_correction_bias for glm4_moe/deepseek_v3, shared experts, dense\n"
    "first layers via first_k_dense_replace, grouped routing for deepseek_v3, tiny attention,\n"
    "norm and embedding tensors), first as a Hugging Face checkpoint (bf16, one shard per layer)\n"
    "in DIR2, then converted to EXL3 into DIR with `exl3-tool quantize`'s converter.\n"
    "\n"
    "  --arch          glm4_moe, deepseek_v3, qwen3_moe, mixtral, glm_moe_dsa, deepseek_v4,\n"
    "                  qwen3_next, glm5_next or qwen4_exp (required)\n"
    "  --output        the EXL3 model directory (with --hf-only: the HF checkpoint)\n"
    "  --hf-output     where the HF checkpoint goes (default: DIR-hf)\n"
    "  --hf-only       write only the HF checkpoint, into DIR\n"
    "  --layers        num_hidden_layers (default 3)\n"
    "  --hidden        hidden_size, multiple of 128 (default 256)\n"
    "  --experts       routed experts per MoE layer (default 16)\n"
    "  --top-k         num_experts_per_tok (default 4)\n"
    "  --intermediate  routed expert intermediate size, multiple of 128 (default 128)\n"
    "  --shared        n_shared_experts (default 1 for glm4_moe, deepseek_v3, glm_moe_dsa,\n"
    "                  deepseek_v4 (always 1) and qwen3_next (0 or 1: its gated shared expert,\n"
    "                  shared_expert_intermediate_size = --intermediate); 0 otherwise)\n"
    "  --dense-layers  first_k_dense_replace (default 1 for glm4_moe/deepseek_v3/glm_moe_dsa, 0\n"
    "                  otherwise; qwen3_next: its first N layers as mlp_only_layers)\n"
    "  --dense-intermediate  dense MLP intermediate_size (default 2 x --intermediate)\n"
    "  --n-group, --topk-group  grouped routing (default 1/1; deepseek_v3: up to 4 groups)\n"
    "  --routed-scaling-factor  (default 1.0; deepseek_v3 2.5, deepseek_v4 1.5)\n"
    "  --swiglu-limit  written to config.json when > 0 (default: none; deepseek_v4 10)\n"
    "  --vocab         vocab_size of the tiny embeddings (default 512)\n"
    "  --max-position  max_position_embeddings (default 4096)\n"
    "  --bits          K of every quantized tensor (default 4)\n"
    "  --expert-bits   K of routed experts (default --bits); shared experts keep --bits\n"
    "  --down-bits     K of down projections (default: no override). Mixed widths, e.g. the\n"
    "                  demo's K=2 MCG with K=4 down: --bits 2 --down-bits 4 --codebook mcg\n"
    "  --codebook      3inst (default), mcg or mul1\n"
    "  --expert-bits-cycle, --expert-codebook-cycle  with --synthetic: comma-separated K (1..8) or\n"
    "                  codebooks; routed expert e's gate, up and down take entry e % count (layers\n"
    "                  whose routed experts differ in K and codebook), e.g. 2,3,4 and mcg,3inst\n"
    "  --quantize-all  quantize attention, dense MLPs (at --bits) and lm_head (at --head-bits,\n"
    "                  default 6) too, as exl3-tool quantize does (default: experts only)\n"
    "  --seed          weights' seed (also the sign vectors'); default 1\n"
    "  --threads       encoder threads, or with --synthetic generating threads (default: all cores)\n"
    "  --quiet         no progress bar\n"
    "\n"
    "  --heads, --kv-heads, --head-dim  attention shape (default 4 heads, 2 KV heads, DeepSeek-V3:\n"
    "                  KV heads = heads, DeepSeek-V4: 1; head dim hidden / heads)\n"
    "  --q-lora-rank, --kv-lora-rank, --qk-nope-head-dim, --qk-rope-head-dim, --v-head-dim\n"
    "                  DeepSeek-V3's and GLM-MoE-DSA's latent attention (default 64, 32, 32,\n"
    "                  16, 32)\n"
    "  --index-heads, --index-head-dim, --index-topk  GLM-MoE-DSA's lightning indexer\n"
    "                  (index_n_heads, index_head_dim, index_topk; default 4, 32, 64; every\n"
    "                  layer runs its own; weights_proj stays bf16); DeepSeek-V4's CSA indexer\n"
    "                  reads the same three\n"
    "\n"
    "  DeepSeek-V4 (DeepseekV4Config's names; --head-dim, --q-lora-rank and --qk-rope-head-dim,\n"
    "  the rotated tail of each head, shape its attention):\n"
    "  --layer-types   one per layer, comma-separated: sliding_attention,\n"
    "                  compressed_sparse_attention, heavily_compressed_attention (default: layer 0\n"
    "                  sliding, then compressed sparse and heavily compressed alternating);\n"
    "                  qwen3_next: linear_attention, full_attention\n"
    "  --sliding-window  (default 8)    --csa-compress-rate  (default 4)\n"
    "  --hca-compress-rate  (default 16; the real models 128)\n"
    "  --o-groups, --o-lora-rank  grouped output projection (default 2, heads x head-dim / groups)\n"
    "  --hc-mult, --hc-sinkhorn-iters  hyper-connection streams and Sinkhorn steps (default 4, 20)\n"
    "  --hash-layers   the first N layers hash-routed (ffn.gate.tid2eid; default 1)\n"
    "\n"
    "  Qwen3-Next (Qwen3NextConfig's names; full attention layers take --heads, --kv-heads,\n"
    "  --head-dim):\n"
    "  --linear-key-heads, --linear-value-heads, --linear-key-head-dim, --linear-value-head-dim,\n"
    "  --linear-conv-kernel  gated DeltaNet shape (default 2, 4, 64, 64, 4)\n"
    "  --full-attention-interval  every N-th layer full attention (default 4, or the last layer of\n"
    "                  a model of fewer layers); --layer-types lists them instead\n"
    "\n"
    "  GLM-5.3-Flash (glm5_next: Glm5NextForConditionalGeneration, config.json in transformers\n"
    "  5.25's form with text_config, vision_config and the image tokens; tensors under\n"
    "  model.language_model.; the vision tower's and the MTP head's tensors are not written, the\n"
    "  engine does not need them). Sigmoid routing with correction bias, shared\n"
    "  expert, dense first layers (--dense-layers, default 1), swiglu_limit (default 10),\n"
    "  routed_scaling_factor (default 2.5); per layer_types Kimi delta attention\n"
    "  (linear_attention) or NoPE MLA (--heads, --q-lora-rank, --kv-lora-rank,\n"
    "  --qk-nope-head-dim, --v-head-dim; --qk-rope-head-dim must be 0, its default here) with the\n"
    "  k-pooled indexer (indexed_attention: --index-heads, --index-head-dim, --index-topk and\n"
    "  --index-kpool, every indexed layer a full indexer); hyper-connections (--hc-mult,\n"
    "  --hc-sinkhorn-iters) on every layer, a mean head:\n"
    "  --linear-heads, --linear-head-dim  KDA's heads and head size (linear_num_heads,\n"
    "                  linear_head_dim; default 2, 64); --linear-conv-kernel its taps (default 4)\n"
    "  --index-kpool   positions per pool of the indexer (default 4; --index-topk a multiple)\n"
    "  --release-layout  config.json in the release checkpoint's layout (deepseek_sparse_attention,\n"
    "                  linear_attn_config) and its processor_config.json: what exllamav3 reads\n"
    "  --layer-types   linear_attention, indexed_attention; default every --full-attention-interval-th\n"
    "                  layer indexed (4: transformers' pattern of three KDA layers to one)\n"
    "  The published GLM-5.3-Flash (Glm5NextTextConfig's defaults in transformers 5.25): hidden\n"
    "  4096, 45 layers (3 dense of 12288, 42 MoE), 288 routed experts of 2048, top 8, one shared,\n"
    "  vocab 154880, 64 heads, q_lora 1536, kv_lora 512, nope 256, v 256, no rope, indexer 32\n"
    "  heads of 128, index_kpool 16, index_topk 2048, KDA 64 heads of 128 with 4 conv taps,\n"
    "  hc_mult 4. The whole model at those shapes as its origin runs it (experts K=2 MCG,\n"
    "  attention K=4, head K=6):\n"
    "    --arch glm5_next --synthetic --whole-model --hidden 4096 --layers 45 --dense-layers 3\n"
    "    --dense-intermediate 12288 --experts 288 --intermediate 2048 --top-k 8 --shared 1\n"
    "    --vocab 154880 --heads 64 --q-lora-rank 1536 --kv-lora-rank 512 --qk-nope-head-dim 256\n"
    "    --v-head-dim 256 --index-heads 32 --index-head-dim 128 --index-kpool 16\n"
    "    --index-topk 2048 --linear-heads 64 --linear-head-dim 128 --max-position 1048576\n"
    "    --bits 2 --codebook mcg --attention-bits 4 --head-bits 6\n"
    "  (82.18 GB; --layers 8, the 3 dense and 5 MoE layers: 11.71 GB)\n"
    "\n"
    "  Qwen3.8-Flash-Next (qwen4_exp: Qwen4ExpForConditionalGeneration, config.json in transformers\n"
    "  5.25's form with text_config, vision_config and the image tokens; tensors under\n"
    "  model.language_model.; the vision tower's tensors are not written). Softmax routing,\n"
    "  one gated shared expert (shared_expert_intermediate_size = --intermediate), every layer MoE;\n"
    "  per layer_types gated DeltaNet (linear_attention: the Qwen3-Next --linear-* flags; in_proj_qkv,\n"
    "  in_proj_z, in_proj_b, in_proj_a; sigmoid output gate) or QSA (indexed_attention: gated GQA of\n"
    "  --heads / --kv-heads / --head-dim, rope on a quarter of each head, and the block indexer:\n"
    "  --index-heads, --index-head-dim, --index-topk (indexer_budget) and --index-kpool\n"
    "  (indexer_compress_ratio, positions per block)); low-rank gated hyper-connections (--hc-mult:\n"
    "  hc_count, --hc-lowrank) instead of layer norms, no final norm; PLE layers (hashed n-gram\n"
    "  embeddings, eos_token_id 1):\n"
    "  --hc-lowrank    rank of the hyper-connections' input mixer (default 32; the real model 320)\n"
    "  --ple-layer-ids one-based linear_attention layers with a PLE layer (default: the first one)\n"
    "  --ple-embed-dim ple_embed_dim (default --hidden); a multiple of the n-gram heads\n"
    "  --ple-conv-kernel  the PLE's dilated conv taps (default 4)\n"
    "  --ngram-size, --heads-per-ngram  (default 3, 8: (3 - 1) x 8 = 16 n-gram heads)\n"
    "  --ngram-vocab-size-base  rows per n-gram head (the next primes; default 1000): the table has\n"
    "                  about heads x V rows of ple_embed_dim / heads. The real model's 20000000 makes\n"
    "                  a table of ~100 GB; 250000 gives 4M rows (1.3 GB at rows of 160), written in\n"
    "                  seconds and still read row by row from the file as the real table is\n"
    "  --split-ngram-parts  pieces of the table (ngram_embedding.shard_{i}; default 512 where that\n"
    "                  cuts it into 512, else 128)\n"
    "  --release-layout  config.json's QSA layers named full_attention (what exllamav3 reads);\n"
    "                  needs n-gram rows of 160 and --index-head-dim a multiple of 128\n"
    "  --layer-types   linear_attention, indexed_attention; default every --full-attention-interval-th\n"
    "                  (4) layer indexed\n"
    "  The published shapes (Qwen4ExpTextConfig's defaults in transformers 5.25): hidden 2048, 40\n"
    "  layers, 512 routed experts of 512, top 10, one shared of 512, vocab 248320, 16 heads / 2 KV\n"
    "  heads of 256, DeltaNet 16 key heads / 32 value heads of 128, hc_count 4, hc_lowrank 320,\n"
    "  ngram_size 3, heads_per_ngram 8; chosen here where transformers has no default:\n"
    "  ple_embed_dim 2560 (rows of 160, the width exllamav3 takes), the indexer 16 heads of 128 with\n"
    "  a budget of 2048 in blocks of 4, ple_layer_ids [1] (layer 0). As exllamav3 runs it (experts\n"
    "  K=2 MCG, attention K=4, head K=6), release layout (scripts/gpu/qwen4_exp_model.sh):\n"
    "    --arch qwen4_exp --synthetic --whole-model --release-layout --hidden 2048 --layers 40\n"
    "    --experts 512 --intermediate 512 --top-k 10 --vocab 248320 --heads 16 --kv-heads 2\n"
    "    --head-dim 256 --linear-key-heads 16 --linear-value-heads 32 --linear-key-head-dim 128\n"
    "    --linear-value-head-dim 128 --hc-lowrank 320 --ple-embed-dim 2560 --heads-per-ngram 8\n"
    "    --ngram-vocab-size-base 250000 --index-heads 16 --index-head-dim 128 --index-topk 2048\n"
    "    --index-kpool 4 --max-position 32768 --bits 2 --codebook mcg --attention-bits 4 --head-bits 6\n"
    "  (--layers 2, a DeltaNet layer with the PLE and a QSA layer: 3.65 GB, 46 s on 2 cores; each\n"
    "  further layer ~0.45 GB)\n"
    "\n"
    "  --mtp           glm4_moe, deepseek_v3, glm_moe_dsa, glm5_next (HF path or --synthetic\n"
    "                  --whole-model): also the DeepSeek-V3 MTP layer model.layers.{layers}.*\n"
    "                  (glm5_next: model.language_model.layers.{layers}.*; enorm, hnorm, eh_proj,\n"
    "                  shared_head.norm, a MoE decoder layer) for --speculative-method mtp;\n"
    "                  qwen4_exp: its own head mtp.* (fc_hidden, fc_embedding, their norms, one QSA\n"
    "                  MoE block mtp.layers.0.*, mtp.hyper_connection_mixer; mtp_num_hidden_layers 1)\n"
    "  --whole-model   with --synthetic: also attention, norms, dense MLPs, embeddings and the\n"
    "                  head (EXL3 where both dimensions are multiples of 128), so exl3-router runs\n"
    "                  it: engine benchmarks at real shapes\n"
    "  --attention-bits  with --synthetic --whole-model: K of attention and dense MLP linears\n"
    "                  (default --bits); --head-bits there sets lm_head's K (default --bits)\n"
    "  --synthetic     write an EXL3 model directly, without an HF checkpoint or encoding: every\n"
    "                  expert's trellis bits random (valid EXL3), suh = +-1, svh = +-1/(1.24\n"
    "                  sqrt(in)); only MoE layers' tensors (router, bias, experts, shared);\n"
    "                  one shard per MoE layer, streamed to disk; for benchmarks at real shapes,\n"
    "                  e.g. GLM-5.3-Flash's experts: --arch glm4_moe --synthetic --hidden 4096\n"
    "                  --experts 288 --top-k 8 --intermediate 2048 --shared 1 --layers 45\n"
    "                  --dense-layers 3 --routed-scaling-factor 2.5 --swiglu-limit 10 --bits 2\n"
    "                  --codebook mcg (about 76 GB). Uses --bits/--down-bits/--codebook, not\n"
    "                  --expert-bits. The whole GLM-5.3-Flash-shaped model the engine runs (82 GB,\n"
    "                  docs/engine.md): --arch glm_moe_dsa --synthetic --whole-model with the\n"
    "                  above and --heads 64 --q-lora-rank 2048 --kv-lora-rank 512\n"
    "                  --qk-nope-head-dim 192 --qk-rope-head-dim 64 --v-head-dim 256\n"
    "                  --index-heads 32 --index-head-dim 128 --index-topk 2048\n"
    "                  --dense-intermediate 12288 --vocab 154880 --max-position 202752\n"
    "                  --attention-bits 4 --head-bits 6. Tensors are generated on --threads\n"
    "                  threads (all cores by default), so the disk sets the pace.\n"
    "  --misaligned-data  with --synthetic: start each shard's data section 8 bytes past a 16-byte\n"
    "                  boundary (the header padded to 8 bytes, as the format allows and Python's\n"
    "                  safetensors does) instead of at a 64-byte one: with --codebook 3inst every\n"
    "                  tensor is then 8- but not 16-byte aligned (mcg/mul1 flags shift later ones\n"
    "                  by 4 more), to test --weights-residency host on such files\n"
    "\n"
    "Generation with the defaults takes about half a minute on a 2-core machine (most of it the\n"
    "Viterbi encoding of 13k tiles); smaller shapes are proportionally faster.\n";

int Run(int argc, char** argv) {
  const char* kName = "make-test-model";
  ToolArgs args;
  std::string err;
  if (!args.Parse(argc, argv,
                  {"arch", "output", "hf-output", "layers", "hidden", "experts", "top-k",
                   "intermediate", "shared", "dense-layers", "dense-intermediate", "n-group",
                   "topk-group", "routed-scaling-factor", "swiglu-limit", "vocab", "bits",
                   "expert-bits", "down-bits", "codebook", "seed", "threads", "head-bits", "attention-bits",
                   "heads", "kv-heads", "head-dim", "q-lora-rank", "kv-lora-rank",
                   "qk-nope-head-dim", "qk-rope-head-dim", "v-head-dim", "index-heads",
                   "index-head-dim", "index-topk", "max-position", "layer-types", "sliding-window",
                   "csa-compress-rate", "hca-compress-rate", "o-groups", "o-lora-rank", "hc-mult",
                   "hc-sinkhorn-iters", "hash-layers", "linear-key-heads", "linear-value-heads",
                   "linear-key-head-dim", "linear-value-head-dim", "linear-conv-kernel",
                   "full-attention-interval", "expert-bits-cycle", "expert-codebook-cycle", "linear-heads",
                   "linear-head-dim", "index-kpool", "hc-lowrank", "ple-layer-ids", "ple-embed-dim",
                   "ple-conv-kernel", "ngram-size", "heads-per-ngram", "ngram-vocab-size-base",
                   "split-ngram-parts"},
                  {"hf-only", "synthetic", "quiet", "quantize-all", "whole-model", "misaligned-data", "mtp",
                   "release-layout"}, &err)) {
    return Fail(kName, err);
  }
  if (args.help) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (!args.Require({"arch", "output"}, &err)) return Fail(kName, err);
  TestModelSpec spec;
  spec.arch = args.Get("arch");
  struct IntFlag {
    const char* name;
    int* out;
  };
  int bits = 4, expert_bits = 0, down_bits = 0, threads = 0, head_bits = 6, attention_bits = 0;
  for (IntFlag f : {IntFlag{"layers", &spec.layers}, {"hidden", &spec.hidden},
                    {"experts", &spec.experts}, {"top-k", &spec.top_k},
                    {"intermediate", &spec.intermediate}, {"shared", &spec.shared},
                    {"dense-layers", &spec.dense_layers},
                    {"dense-intermediate", &spec.dense_intermediate}, {"n-group", &spec.n_group},
                    {"topk-group", &spec.topk_group}, {"vocab", &spec.vocab}, {"bits", &bits},
                    {"expert-bits", &expert_bits}, {"down-bits", &down_bits},
                    {"threads", &threads}, {"head-bits", &head_bits},
                    {"attention-bits", &attention_bits}, {"heads", &spec.heads},
                    {"kv-heads", &spec.kv_heads}, {"head-dim", &spec.head_dim},
                    {"q-lora-rank", &spec.q_lora_rank}, {"kv-lora-rank", &spec.kv_lora_rank},
                    {"qk-nope-head-dim", &spec.qk_nope_head_dim},
                    {"qk-rope-head-dim", &spec.qk_rope_head_dim},
                    {"v-head-dim", &spec.v_head_dim}, {"index-heads", &spec.index_heads},
                    {"index-head-dim", &spec.index_head_dim}, {"index-topk", &spec.index_topk},
                    {"max-position", &spec.max_position},
                    {"sliding-window", &spec.sliding_window},
                    {"csa-compress-rate", &spec.csa_compress_rate},
                    {"hca-compress-rate", &spec.hca_compress_rate}, {"o-groups", &spec.o_groups},
                    {"o-lora-rank", &spec.o_lora_rank}, {"hc-mult", &spec.hc_mult},
                    {"hc-sinkhorn-iters", &spec.hc_sinkhorn_iters},
                    {"hash-layers", &spec.hash_layers},
                    {"linear-key-heads", &spec.linear_key_heads},
                    {"linear-value-heads", &spec.linear_value_heads},
                    {"linear-key-head-dim", &spec.linear_key_head_dim},
                    {"linear-value-head-dim", &spec.linear_value_head_dim},
                    {"linear-conv-kernel", &spec.linear_conv_kernel},
                    {"full-attention-interval", &spec.full_attention_interval},
                    {"linear-heads", &spec.linear_heads}, {"linear-head-dim", &spec.linear_head_dim},
                    {"index-kpool", &spec.index_kpool}, {"hc-lowrank", &spec.hc_lowrank},
                    {"ple-embed-dim", &spec.ple_embed_dim}, {"ple-conv-kernel", &spec.ple_conv_kernel},
                    {"ngram-size", &spec.ngram_size}, {"heads-per-ngram", &spec.heads_per_ngram},
                    {"split-ngram-parts", &spec.split_ngram_parts}}) {
    if (args.Has(f.name) && !args.GetInt(f.name, f.out, &err)) return Fail(kName, err);
  }
  if (args.Has("ngram-vocab-size-base") &&
      !absl::SimpleAtoi(args.Get("ngram-vocab-size-base"), &spec.ngram_vocab_size_base)) {
    return Fail(kName, "--ngram-vocab-size-base must be an integer");
  }
  for (absl::string_view id : absl::StrSplit(args.Get("ple-layer-ids"), ',', absl::SkipEmpty())) {
    int v = 0;
    if (!absl::SimpleAtoi(id, &v)) return Fail(kName, "--ple-layer-ids: one-based layer ids, comma-separated");
    spec.ple_layer_ids.push_back(v);
  }
  if (args.Has("layer-types")) {
    spec.layer_types = absl::StrSplit(args.Get("layer-types"), ',', absl::SkipEmpty());
  }
  for (auto [name, out] : {std::pair<const char*, float*>{"routed-scaling-factor", &spec.routed_scaling_factor},
                           {"swiglu-limit", &spec.swiglu_limit}}) {
    if (args.Has(name) && !absl::SimpleAtof(args.Get(name), out)) {
      return Fail(kName, std::string("--") + name + " must be a number");
    }
  }
  if (args.Has("seed") && !absl::SimpleAtoi(args.Get("seed"), &spec.seed)) {
    return Fail(kName, "--seed must be a non-negative integer");
  }
  for (int k : {bits, expert_bits, down_bits, head_bits, attention_bits}) {
    if (k != 0 && (k < 1 || k > 8)) return Fail(kName, "bit widths must be in 1..8");
  }
  if (bits < 1) return Fail(kName, "--bits must be in 1..8");
  Codebook cb;
  if (!ParseCodebook(args.Get("codebook", "3inst"), &cb)) {
    return Fail(kName, "--codebook must be 3inst, mcg or mul1, got '" + args.Get("codebook") + "'");
  }
  spec.mtp = args.Bool("mtp");
  spec.release_layout = args.Bool("release-layout");
  if (spec.mtp && args.Bool("synthetic") && !args.Bool("whole-model"))
    return Fail(kName, "--mtp goes with the HF path or --synthetic --whole-model (the MTP layer is a whole layer)");
  absl::StatusOr<TestModelSpec> resolved = ResolveTestModelSpec(spec);
  if (!resolved.ok()) return Fail(kName, std::string(resolved.status().message()));
  const std::string out = args.Get("output");
  const bool progress = !args.Bool("quiet");

  if (args.Bool("whole-model") && !args.Bool("synthetic")) {
    return Fail(kName, "--whole-model goes with --synthetic (the HF path always writes whole models)");
  }
  if (args.Has("attention-bits") && !args.Bool("whole-model")) {
    return Fail(kName, "--attention-bits goes with --synthetic --whole-model (exl3-tool quantize's converter sets the "
                       "attention's K from --bits otherwise)");
  }
  if (args.Bool("misaligned-data") && !args.Bool("synthetic")) {
    return Fail(kName, "--misaligned-data goes with --synthetic");
  }
  if ((args.Has("expert-bits-cycle") || args.Has("expert-codebook-cycle")) && !args.Bool("synthetic")) {
    return Fail(kName, "--expert-bits-cycle and --expert-codebook-cycle go with --synthetic");
  }
  if (args.Bool("synthetic")) {
    if (args.Bool("hf-only") || args.Has("hf-output") || args.Has("expert-bits")) {
      return Fail(kName, "--synthetic writes EXL3 directly: --hf-only, --hf-output and --expert-bits do not apply");
    }
    SyntheticOptions so;
    so.whole_model = args.Bool("whole-model");
    so.bits = bits;
    so.down_bits = down_bits;
    so.attention_bits = attention_bits;
    so.head_bits = args.Has("head-bits") ? head_bits : 0;
    so.codebook = cb;
    so.progress = progress;
    so.threads = threads;
    if (args.Bool("misaligned-data")) so.data_start = DataSectionStart::k8PastA16ByteBoundary;
    for (absl::string_view k : absl::StrSplit(args.Get("expert-bits-cycle"), ',', absl::SkipEmpty())) {
      int v = 0;
      if (!absl::SimpleAtoi(k, &v) || v < 1 || v > 8) {
        return Fail(kName, "--expert-bits-cycle: bit widths in 1..8, comma-separated");
      }
      so.expert_bits_cycle.push_back(v);
    }
    for (absl::string_view name : absl::StrSplit(args.Get("expert-codebook-cycle"), ',', absl::SkipEmpty())) {
      Codebook c;
      if (!ParseCodebook(std::string(name), &c)) {
        return Fail(kName, "--expert-codebook-cycle: 3inst, mcg or mul1, comma-separated");
      }
      so.expert_codebook_cycle.push_back(c);
    }
    if (progress) {
      std::fprintf(stderr, "exl3-tool make-test-model: writing %.2f GB of synthetic EXL3 shards to %s\n",
                   SyntheticModelBytes(*resolved, so) / 1e9, out.c_str());
    }
    absl::Status s = WriteSyntheticExl3Model(*resolved, so, out);
    if (!s.ok()) return Fail(kName, std::string(s.message()));
    return 0;
  }

  const std::string hf_dir = args.Bool("hf-only") ? out : args.Get("hf-output", out + "-hf");
  if (!args.Bool("hf-only") && hf_dir == out) {
    return Fail(kName, "--hf-output must differ from --output");
  }
  absl::Status s = WriteHfTestModel(*resolved, hf_dir, progress);
  if (!s.ok()) return Fail(kName, std::string(s.message()));
  if (args.Bool("hf-only")) return 0;
  ConvertOptions co;
  co.bits = bits;
  co.expert_bits = expert_bits;
  co.down_bits = down_bits;
  co.codebook = cb;
  co.seed = spec.seed;
  co.threads = threads;
  co.progress = progress;
  // By default only the routed and shared experts are quantized (the expert side's tests and the
  // demo keep their models); --quantize-all converts every linear as `exl3-tool quantize` does.
  const bool all = args.Bool("quantize-all");
  co.quantize_attention = all;
  co.quantize_dense_mlp = all;
  co.head_bits = all ? head_bits : 0;
  absl::StatusOr<ConvertStats> st = ConvertCheckpoint(hf_dir, out, co);
  if (!st.ok()) return Fail(kName, std::string(st.status().message()));
  if (progress) {
    std::fprintf(stderr,
                 "exl3-tool make-test-model: %s (HF checkpoint in %s): %d tensors quantized, "
                 "mean relative error %.3e\n",
                 out.c_str(), hf_dir.c_str(), st->tensors_quantized, st->mean_relative_mse);
  }
  return 0;
}

}  // namespace
}  // namespace exl3::tool

EXL3_TOOL_SUBCOMMAND(kMakeTestModelRegistered, "make-test-model",
                     "write a random MoE test model (HF + EXL3, or synthetic EXL3)",
                     exl3::tool::Run);
