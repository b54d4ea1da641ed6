#!/usr/bin/env bash
# One call on the GPU machine: install, check every kernel and the engine on the GPU, benchmark.
#   bash scripts/gpu_all.sh [tests] [kernels] [bench] [plain] [attention] [prefill] [mixtral] [verify] [real GGUF GOLDEN] [cli GGUF] [sanitize TOOL tests|steps ITEMS] [long]
#                           [prefill-real GGUF] [startup TOKENIZER.npz] [sweep DTYPES] [rows] [rows-leads] [depths] [attention-ncu] [ptx] [serving DTYPES] [wgmma] [wgmma-rows] [decode]
#                           [cache-out] [warm DTYPES] [rows-ncu] [rows-attention] [rows-x] [attention-fixed] [mixtral-prefill] [rows-small]
#                           [matmul-tests] [sanitize-matmul] [serve-musts] [sample] [prompt-eager] [speculative] [pair]
#                           [prefill-musts] [fold-32] [serve-warm] [pair-attention] [musts] [merge-loads] [tiles-split] [panel-ncu] [rmsnorm] [rows-32-kinds]
#   (default: tests kernels bench)
# Expects the numpy/gguf wheels in .whl/ (bash scripts/gpu_wheels.sh). Logs go to $OUT (or ./gpu-out).
# The compiled kernels (pycalm.gpu.kernel_cache, a folder a version of each kernel module) do not
# outlive the machine, and a fresh one spends most of a step compiling: `cache-out` packs this
# tree's folders into $OUT as parts of at most 15 MiB (kernels.tar.xz.00, .01, ...); copied into
# .kcache/ here and carried with the next call, they are unpacked first, so that call compiles
# only what changed (a kernel module edited gives it and its importers new folders).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
kernels_root=${XDG_CACHE_HOME:-$HOME/.cache}/pycalm/kernels  # pycalm.paths.cache_dir()'s kernels/
if compgen -G ".kcache/kernels.tar.xz.*" >/dev/null; then
  mkdir -p "$kernels_root" && cat .kcache/kernels.tar.xz.* | tar -xJ -C "$kernels_root" \
    && echo "kernel cache: $(find "$kernels_root" -name '*.nbc' | wc -l) compiled kernels unpacked"
fi
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests kernels bench)
i=0
while [ $i -lt ${#steps[@]} ]; do
  step=${steps[$i]}; i=$((i + 1))
  echo "=== $step $(date +%T)"
  case $step in
    tests)   PYCALM_TEST_GPU=1 python3 -m pytest -q -p no:cacheprovider tests/test_common.py tests/test_matvec.py \
               tests/test_qkv.py tests/test_attention.py tests/test_embed.py tests/test_simple.py tests/test_sample.py \
               tests/test_model.py tests/test_moe.py 2>&1 | tee "$out/tests.log" | tail -25 ;;
    kernels) python3 scripts/kernels/matvec.py 2>&1 | tee "$out/kernels_matvec.log" | tail -40
             python3 scripts/kernels/attention.py 2>&1 | tee "$out/kernels_attention.log" | tail -25
             python3 scripts/kernels/sample.py 2>&1 | tee "$out/kernels_sample.log" | tail -12 ;;
    bench)   python3 scripts/bench.py --json "$out/bench.json" 2>&1 | tee "$out/bench.log" | tail -20 ;;
    plain)   python3 scripts/bench.py --plain --json "$out/bench_plain.json" 2>&1 | tee "$out/bench_plain.log" | tail -20 ;;
    attention) python3 scripts/kernels/attention.py --check 2>&1 | tee "$out/kernels_attention.log" | grep -A40 "=== summary" ;;
    prefill) PYCALM_TEST_GPU=1 python3 -m pytest -q -p no:cacheprovider tests/test_prefill.py tests/test_moe_rows.py \
               tests/test_rows.py tests/test_prefill_attention.py tests/test_matmul.py 2>&1 | tee "$out/tests_prefill.log" | tail -15
             python3 scripts/kernels/prefill_attention.py 2>&1 | tee "$out/kernels_prefill_attention.log" | tail -30
             python3 scripts/bench.py --prefill --no-decode --shapes llama3-8b,tinyllama-1.1b,mixtral-8x7b \
               --dtypes fp16,fp8,gf4,q8,q4 --json "$out/bench_prefill.json" 2>&1 | tee "$out/bench_prefill.log" | tail -60 ;;
    depths)  python3 scripts/bench.py --depths 0,4000,8000,16000,32000 --shapes llama3-8b --dtypes fp16,q4 \
               --kv fp16,fp8 2>&1 | tee "$out/bench_depths.log" | tail -8
             # issue 32 at 8,000 (fp16 184 of 190 tok/s): at most 256 blocks a launch, half the splits to merge
             python3 scripts/bench.py --depths 0,8000,16000,32000 --shapes llama3-8b --dtypes fp16 --kv fp16 \
               --attention-blocks 256 2>&1 | tee -a "$out/bench_depths.log" | tail -3
             python3 scripts/kernels/attention.py --shapes Llama-3-8B --n-pos 256,4000,8000,16000,32000 \
               --variants default,s_t8st2,s_st3,s_tg256 --check 2>&1 | tee "$out/kernels_attention_long.log" \
               | grep -A30 "=== summary" ;;
    attention-fixed)  # issue 32: the ~25 us a layer that does not grow with the context: the merge
             # (probes without it), two blocks an SM (pad2) and 256 blocks, alone at 4k, 8k and 32k
             python3 scripts/kernels/attention.py --shapes Llama-3-8B --n-pos 4000,8000,32000 --check \
               --variants default,s_nomerge,s_pad2,s_tg256,s_tg256_nomerge,s_tg256_pad2 2>&1 \
               | tee "$out/kernels_attention_fixed.log" | grep -A30 "=== summary" ;;
    attention-ncu)  # issue 32: where the decode attention's time goes at 4k and 32k positions (8B, fp16 KV):
             # issue stalls, occupancy and DRAM throughput of two launches at each length
             for n in 4000 8000 32000; do  # (8,000: where fp16 decode misses issue 32's bar, 184 of 190 tok/s)
               ncu --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
                 --section MemoryWorkloadAnalysis -k regex:attention_kernel --launch-skip 40 --launch-count 2 \
                 python3 scripts/kernels/attention.py --shapes Llama-3-8B --n-pos $n 2>&1 \
                 | tee "$out/ncu_attention_$n.log" | grep -E "Duration|DRAM Throughput|Achieved Occupancy|Issued Ipc|No Eligible|Stall|Warp Cycles Per Issued" | head -40
             done ;;
    rows)    PYCALM_TEST_GPU=1 python3 -m pytest -q -p no:cacheprovider tests/test_matmul.py -k skinny \
               tests/test_paged_attention.py tests/test_sample_rows.py 2>&1 | tee "$out/tests_rows.log" | tail -8
             python3 scripts/kernels/rows_matmul.py --no-tile 2>&1 | tee "$out/kernels_rows.log" | tail -12
             # gf4 with two A tiles (its fp16 decode compiles them without spill in blocks of 8 warps)
             python3 scripts/kernels/rows_matmul.py --dtypes gf4 --rows 8,32,64 --row-tiles "0,0,1;0,0,2;8,0,2" \
               2>&1 | tee -a "$out/kernels_rows.log" | tail -8
             python3 scripts/bench.py --rows --shapes llama3-8b,tinyllama-1.1b --dtypes fp16,fp8,gf4,q8,q4 \
               2>&1 | tee "$out/bench_rows.log" | tail -14
             python3 scripts/bench.py --rows --shapes mixtral-8x7b --dtypes fp8,gf4 \
               2>&1 | tee -a "$out/bench_rows.log" | tail -4  # issue 29's third shape
             python3 scripts/bench.py --invariant-decode --shapes llama3-8b,tinyllama-1.1b --dtypes fp16,q4 \
               --tokens 64 2>&1 | tee -a "$out/bench_rows.log" | tail -4 ;;
    warm)    dtypes=${steps[$i]}; i=$((i + 1))  # the 8B shape's kernels in these formats, every format's
             # compile workers at once (a fresh machine; the later steps then load them), e.g. q4,q8,gf4
             python3 scripts/warm_kernels.py --shapes llama3-8b --dtypes "$dtypes" 2>&1 | tee "$out/warm.log" | tail -8 ;;
    rows-leads)  # issue 29 at 32 and 64 rows in the 4-bit and 8-bit formats, where the pass is 2.8-4.6x
             # the token step (H100, 2026-12-05): skinny's two-tile warps with registers for two blocks
             # an SM (128; gf4 and q4 take 132 and 156, one block) against one; the split tile's shape
             # (MID_TILE 64 x 64 against wider W tiles: more weight bytes in flight a step); the pass
             python3 scripts/kernels/rows_matmul.py --dtypes gf4,q4,q8 --rows 32 --row-tiles "0,0,2;0,2,2" \
               2>&1 | tee "$out/kernels_rows_leads.log" | tail -14
             python3 scripts/kernels/rows_matmul.py --dtypes gf4,q4,q8,fp8 --rows 32,64 \
               --tiles "64,64,2,2,4,4;64,128,2,4,4,2;32,128,1,4,4,4;64,128,2,2,4,2;32,128,2,2,4,4" 2>&1 \
               | tee -a "$out/kernels_rows_leads.log" | tail -34
             python3 scripts/bench.py --rows 8,32,64 --shapes llama3-8b --dtypes gf4,q4,fp8,q8 2>&1 \
               | tee "$out/bench_rows_leads.log" | tail -8 ;;
    rows-ncu)  # issue 29: why the split tile runs a 64-row layer at 120 TFLOP/s whatever the format (fp16
             # and gf4 alike, weight loads fetched 4 steps ahead no faster): the first layer's four
             # products of a 64-row pass, gf4 and q4, stalls and issue; then the prefill attention of a
             # 32-row pass (50 us a layer under ncu, 4x the token step's)
             for d in gf4 q4; do
               ncu --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
                 --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis_Tables -k regex:matmul_kernel \
                 --launch-count 4 python3 scripts/kernels/rows_pass_profile.py $d 64 2>&1 | tee "$out/ncu_rows_$d.log" \
                 | grep -E "Duration|Throughput|Achieved Occupancy|Issued Ipc|No Eligible|Stall|Warp Cycles Per Issued|Registers|Block Limit" | head -60
             done
             ncu --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
               -k regex:prefill_attention --launch-count 1 python3 scripts/kernels/rows_pass_profile.py gf4 32 2>&1 \
               | tee "$out/ncu_rows_attention.log" | grep -E "Duration|Throughput|Achieved Occupancy|Issued Ipc|Stall|Warp Cycles" | head -20 ;;
    rows-x)  # issue 29 at 32 rows: q4's and gf4's X for four n-tiles loaded with the chunk's weights
             # (the package's, skinny.X_AHEAD: 64 words) against 16 bytes where used (x_words 32), and
             # the package's compiled for two blocks an SM (ptxas: 128 registers, 52-92 bytes spilled)
             python3 scripts/kernels/rows_matmul.py --dtypes q4,gf4 --rows 32 --row-tiles "0,0,2,32;0,0,2;0,2,2" \
               2>&1 | tee "$out/kernels_rows_x.log" | grep -E "layer|check|WRONG" ;;
    rows-small)  # issue 29 at 8 and 16 rows: one A tile a warp against two and four (skinny.ROW_TILES:
             # at 8 rows a 4-bit format's X, read from L2 once a block per A tile, is about twice its
             # weight bytes), fp16 and fp8 first (the 2026-12-06 run timed q4, gf4 and q8)
             python3 scripts/kernels/rows_matmul.py --dtypes fp16,fp8,q4,gf4,q8 --rows 8,16 \
               --row-tiles "0,0,1;0,0,2;0,0,4" 2>&1 | tee "$out/kernels_rows_small.log" | grep -E "layer|check|WRONG" ;;
    rows-attention)  # issue 29: the prefill attention's block shapes for rows passes of 32 and 64 rows, at
             # positions 128 and 4,000 (a block a kv head and 16 positions now: 16-32 blocks on the 8B shape)
             for p0 in 128 4000; do
               python3 scripts/kernels/prefill_attention.py --variants shipped,w2,k32,w2k32,w1,w1k32,w1k16 \
                 --rows 32,64 --pos0 $p0 2>&1 | tee -a "$out/kernels_rows_attention.log" | grep -A30 "=== summary"
             done ;;
    fold-32)  # issue 29: the folded RMSNorms against the unfolded pass at 16 and 32 rows in one run (whether
             # prefill.FOLD_ROWS stays at 32: on an H100, 2026-12-07, 32 rows gained nothing against another run)
             python3 scripts/kernels/rows_launches.py --shapes llama3-8b --dtypes fp16,q8,q4 --rows 16,32 2>&1 \
               | tee "$out/rows_launches_32.log" | tail -12 ;;
    serve-warm)  # issue 31: the precompile's batch group on the GPU (the cold run's test), then the server's
             # first rows, which compiled kernels mid-run before it (8 streams: 7.88 s of captures, 2026-12-07)
             PYCALM_TEST_GPU=1 python3 -m pytest -q -p no:cacheprovider -n 2 tests/test_precompile.py \
               -k "cold_run or walk_reaches" 2>&1 | tee "$out/tests_precompile.log" | tail -3
             python3 scripts/bench_serve.py --streams 8,32,64 --shape llama3-8b --dtype fp16 2>&1 \
               | tee "$out/bench_serve_warm.log" | tail -5 ;;
    pair-attention)  # issue 30: the speculative pair's decode attention at 1-300 positions (the draft's step
             # in the loop 0.785 ms on the H200 against 0.69 at position 0), the shortest split 32 to 256
             python3 scripts/kernels/attention.py --shapes Qwen2.5-0.5B,Qwen2.5-1.5B --n-pos 1,64,160,300 \
               --variants default,s_c64,s_c128,s_c256,s_nomerge --check 2>&1 | tee "$out/kernels_attention_pair.log" \
               | grep -A40 "=== summary" ;;
    musts)   # every open issue's H200 rows in one call (about 8 minutes on a fresh machine; the
             # tests last, so that a call cut by its time limit still has the figures): issue 34's
             # prefill Musts, issue 32's depths, issue 29's rows table and batch-invariant decode,
             # then the GPU tests of what changed last (the decode attention's merge, the panel
             # products, the prefill attention's key splits)
             python3 scripts/bench.py --prefill --no-decode --shapes llama3-8b --dtypes fp16,q8,q4 --lengths 2048 \
               --split none 2>&1 | tee "$out/bench_prefill_musts.log" | tail -6
             python3 scripts/bench.py --depths 0,8000,16000,32000 --shapes llama3-8b --dtypes fp16,q4 --kv fp16 2>&1 \
               | tee "$out/bench_depths.log" | tail -4
             python3 scripts/bench.py --rows 1,8,16,32,64 --shapes llama3-8b --dtypes fp16,fp8,gf4,q8,q4 2>&1 \
               | tee "$out/bench_rows.log" | tail -8
             python3 scripts/bench.py --invariant-decode --shapes llama3-8b --dtypes fp16,q4 --tokens 64 2>&1 \
               | tee -a "$out/bench_rows.log" | tail -4
             PYCALM_TEST_GPU=1 python3 -m pytest -q -rf -n "$(nproc)" -p no:cacheprovider tests/test_attention.py \
               tests/test_paged_attention.py tests/test_prefill_attention.py tests/test_matmul.py \
               -k "attention or panel or split or fold" 2>&1 | tee "$out/tests_musts.log" | tail -3 ;;
    tiles-split)  # what the prefill attention's key splits (two tiles a split at least, since the
             # H100 run of 2026-12-07: 160 keys unsplit, 4,000 positions 68 / 66 / 90 us at 17 / 32 /
             # 64 rows against 412 / 415 / 404) and the panel's folds have not yet had on a GPU: the
             # rows pass deep in the context split and unsplit, and compute-sanitizer over both
             for unsplit in "" --tiles-unsplit; do  # a chat turn or drafts deep in the context
               python3 scripts/bench.py --rows 16,32,64 --rows-at 4000 --shapes llama3-8b --dtypes q4,fp16 $unsplit \
                 2>&1 | tee -a "$out/bench_rows.log" | tail -3
             done
             # issues 29 / 32: compute-sanitizer clean over the new launches (the split cases, the folds)
             SANITIZE_PYTEST_ARGS="-k 'True or split_counts'" bash scripts/sanitize.sh memcheck,racecheck tests \
               test_prefill_attention 2>&1 | tee "$out/sanitize_tiles.log" | grep -E "SUMMARY|test_" | tail -6
             SANITIZE_PYTEST_ARGS="-k 'folds_the_next_norm'" bash scripts/sanitize.sh memcheck,racecheck tests \
               test_matmul 2>&1 | tee "$out/sanitize_folds.log" | grep -E "SUMMARY|test_" | tail -6 ;;
    panel-ncu)  # issue 29: where the panel's 64-row passes stall (H100, 2026-12-07: q4 8.34 ms, gf4
             # 7.81, q8 9.05; a layer's products 186 / 167 us against their weights' 37-40 us at the
             # copy ceiling and about 50 us of issue): the gate launch (the third panel launch of
             # the first layer) of q4, gf4 and q8, stalls and issue
             for d in q4 gf4 q8; do
               ncu --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
                 --section MemoryWorkloadAnalysis -k regex:panel_kernel --launch-skip 2 --launch-count 1 \
                 python3 scripts/kernels/rows_pass_profile.py $d 64 2>&1 | tee "$out/ncu_panel_$d.log" \
                 | grep -E "Duration|Throughput|SM Frequency|Achieved Occupancy|Issued Ipc|No Eligible|Stall|Warp Cycles Per Issued|Registers" | head -40
             done ;;
    rows-32-kinds)  # issue 29: q4's and gf4's 17-32-row pass with the gate alone on the panel (shipped,
             # prefill.SKINNY_GATE_ROWS, chosen from the launches' times), every product on it
             # (5.79 / 5.46 ms on an H100, 2026-12-07) and every product on skinny (6.64 / 6.15)
             for kinds in gate all none; do
               python3 scripts/kernels/rows_kinds.py "$kinds" 2>&1 | tee -a "$out/bench_rows_32_kinds.log" \
                 | grep -E "^\| llama|^="
             done ;;
    rmsnorm)  # issue 29: the rows pass's RMSNorm launch (11 us under ncu for 64 rows) against a row's
             # values held in registers (scripts/kernels/rmsnorm_rows.py; the same bits where the
             # widths match), at the 8B's dim over 8 to 2,048 rows
             python3 scripts/kernels/rmsnorm_rows.py 2>&1 | tee "$out/kernels_rmsnorm.log" | tail -20 ;;
    merge-loads)  # issues 30 and 32: the decode attention's merge loading 8 splits a round against 4
             python3 scripts/kernels/attention.py --shapes Llama-3-8B,Qwen2.5-0.5B --n-pos 300,8000,32000 \
               --variants default,s_m8,s_nomerge --check 2>&1 | tee "$out/kernels_attention_merge.log" \
               | grep -A30 "=== summary" ;;
    prefill-musts)  # issue 34's Musts on the H200 (8B fp16 >= 26,000, q8 >= 16,000, q4 >= 13,000 tok/s
             # at 2,048 tokens), then Mixtral fp16, the cell only an H200 holds
             python3 scripts/bench.py --prefill --no-decode --shapes llama3-8b --dtypes fp16,q8,q4 --lengths 2048 \
               --split none 2>&1 | tee "$out/bench_prefill_musts.log" | tail -6
             python3 scripts/bench.py --prefill --no-decode --shapes mixtral-8x7b --dtypes fp16 --lengths 2048 \
               --split none 2>&1 | tee -a "$out/bench_prefill_musts.log" | tail -4 ;;
    mixtral-prefill)  # issue 34's "no shape slower": Mixtral-8x7B's prompt pass at 2,048 tokens in every
             # format, beside docs/BENCHMARKS.md's 2026-12-05 H200 row (fp16's 94 GB fit an H200 only)
             python3 scripts/bench.py --prefill --no-decode --shapes mixtral-8x7b --dtypes fp16,fp8,gf4,q8,q4 \
               --lengths 2048 --split none 2>&1 | tee "$out/bench_prefill_mixtral.log" | tail -12 ;;
    matmul-tests)  # issue 34: the tile's, skinny's and the experts' GPU tests (248), every core a worker;
             # -rf names any failure even where the call's time runs out first
             PYCALM_TEST_GPU=1 python3 -m pytest -q -rf -n "$(nproc)" -p no:cacheprovider tests/test_matmul.py \
               tests/test_moe_rows.py 2>&1 | tee "$out/tests_matmul.log" | tail -12 ;;
    sanitize-matmul)  # issue 34: test_matmul under the four tools, the tile's tests and skinny's side by
             # side (eight lanes on one GPU; run matmul-tests first, so that the kernels load from the cache)
             for tool in memcheck racecheck synccheck initcheck; do
               for slice in tile skinny; do
                 args="-k 'not skinny and not wgmma'"; [ $slice = skinny ] && args="-k skinny"
                 mkdir -p "$out/$tool-$slice"
                 OUT="$out/$tool-$slice" SANITIZE_PYTEST_ARGS="$args" bash scripts/sanitize.sh $tool tests test_matmul \
                   > "$out/$tool-$slice/summary.txt" 2>&1 &
               done
             done
             wait
             for f in "$out"/*-*/summary.txt; do echo "== $f"; tail -3 "$f"; done ;;
    mixtral) python3 scripts/bench.py --shapes mixtral-8x7b --dtypes fp8,gf4 --json "$out/bench_mixtral.json" 2>&1 | tee "$out/bench_mixtral.log" | tail -8 ;;
    verify)  python3 scripts/verify_transformers.py --engine gpu 2>&1 | tee "$out/verify.log" | tail -15 ;;
    cli)     gguf=${steps[$i]}; i=$((i + 1))
             python3 -m pycalm.generate "$gguf" --cache-dir /tmp/pycalm-cache -i "The capital of France is" -n 64 -t 0 2>&1 | tee "$out/cli.log"
             python3 -m pycalm.generate "$gguf" --cache-dir /tmp/pycalm-cache -i "Once upon a time" -n 200 -s 7 2>&1 | tee -a "$out/cli.log" ;;
    real)    gguf=${steps[$i]}; golden=${steps[$((i + 1))]}; i=$((i + 2))
             python3 scripts/check_real_gpu.py "$gguf" "$golden" 2>&1 | tee -a "$out/real.log" | tail -20 ;;
    sanitize) tool=${steps[$i]}; group=${steps[$((i + 1))]}; items=${steps[$((i + 2))]}; i=$((i + 3))
             # ITEMS: comma-separated test files (tests) or ARCHS (steps), or "all"
             [ "$items" = all ] && items=""
             if [ "$group" = tests ]; then bash scripts/sanitize.sh "$tool" tests ${items//,/ }
             else bash scripts/sanitize.sh "$tool" steps $items; fi 2>&1 | tee -a "$out/sanitize.log" ;;
    long)    python3 scripts/long_run.py 2>&1 | tee "$out/long_run.log" | tail -20 ;;
    prefill-real) gguf=${steps[$i]}; i=$((i + 1))  # the whole output in $out: it is long
             python3 scripts/check_prefill_real.py "$gguf" 2>&1 | tee "$out/prefill_real.log" | grep -v "^   " | tail -40 ;;
    startup) npz=${steps[$i]}; i=$((i + 1))  # SmolLM2's tokenizer file (bench_startup.py tokenizer)
             python3 scripts/bench_startup.py run --tokenizer "$npz" --json "$out/startup.json" 2>&1 | tee "$out/startup.log" | tail -20 ;;
    ptx)     # the compile check of every launched kernel (not in CI: its workers take the 16 cores here)
             python3 -m pytest -q -n 0 -p no:cacheprovider tests/test_ptx.py 2>&1 | tee "$out/tests_ptx.log" | tail -15 ;;
    serving) dtypes=${steps[$i]}; i=$((i + 1))  # the batched engine and the server under load, e.g. fp16,q4
             PYCALM_TEST_GPU=1 python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_batched_gpu.py \
               tests/test_eos_options.py 2>&1 | tee "$out/tests_serving.log" | tail -6
             python3 scripts/bench_batched.py --seqs 1,64 --pos 384 --reps 5 2>&1 | tee "$out/bench_batched.log" | tail -10
             # each row bucket's step (64 decode rows and a chunk: 128, 256, 512, 1,024 rows): the stand-in's table
             python3 scripts/bench_batched.py --seqs 64 --pos 384 --chunk 64,192,448,960 --reps 3 --dtypes "$dtypes" 2>&1 \
               | tee -a "$out/bench_batched.log" | tail -14
             for dtype in ${dtypes//,/ }; do  # issue 31's table: 256 in / 256 out, then 1,000-token prompts (fp16)
               python3 scripts/bench_serve.py --streams 1,8,32,64,128 --shape llama3-8b --dtype "$dtype" 2>&1 \
                 | tee -a "$out/bench_serve.log" | tail -6
               # steps of up to 512 rows (fp16 and fp8 take wgmma from 512)
               python3 scripts/bench_serve.py --streams 32,64 --batch-size 512 --shape llama3-8b --dtype "$dtype" 2>&1 \
                 | tee -a "$out/bench_serve.log" | tail -3
             done
             python3 scripts/bench_serve.py --streams 1,8,32,64,128 --prompt 1000 --shape llama3-8b --dtype fp16 2>&1 \
               | tee -a "$out/bench_serve.log" | tail -6
             # one user with a long prompt, the batch's path (--parallel auto's) against the one-at-a-time worker
             for how in "" --plain; do
               python3 scripts/bench_serve.py --streams 1 --prompt 2000 --new 128 --context 4096 $how \
                 --shape llama3-8b --dtype fp16 2>&1 | tee -a "$out/bench_serve.log" | tail -2
             done ;;
    sample)  # the sampler's passes (the selects' bin walk, max and mass in one pass, the batched
             # one-block argmax): its GPU tests, its kernel table beside docs/BENCHMARKS.md's
             # (temperature alone 0.38 ms, top-p 0.34, top-k + top-p 0.44 over 128,256 logits), and
             # its tests under racecheck and memcheck (the stages share shared memory)
             PYCALM_TEST_GPU=1 python3 -m pytest -q -p no:cacheprovider tests/test_sample.py tests/test_sample_rows.py \
               2>&1 | tee "$out/tests_sample.log" | tail -4
             python3 scripts/kernels/sample.py 2>&1 | tee "$out/kernels_sample.log" | tail -14
             SANITIZE_GPUS=0,0 bash scripts/sanitize.sh racecheck,memcheck tests test_sample test_sample_rows 2>&1 \
               | tail -6 ;;
    prompt-eager)  # a short prompt's pass as generate runs it (engine.prefill: plain launches from
             # Python, wall clock to the stream's end) beside the captured rows pass of the same rows
             # (graph replays), q4 and fp16: what the launches add to a chat turn's first token and to
             # bench.py --invariant-decode's figure from the call (its 15-row prompt)
             python3 scripts/bench.py --prefill --no-decode --lengths 8,16,64 --shapes llama3-8b --dtypes q4,fp16 \
               --split none 2>&1 | tee "$out/bench_prompt_eager.log" | tail -6
             python3 scripts/bench.py --rows 8,16,64 --shapes llama3-8b --dtypes q4,fp16 2>&1 \
               | tee -a "$out/bench_prompt_eager.log" | tail -4 ;;
    speculative)  # issue 30 on the GPU: Qwen2.5-Coder-0.5B and 1.5B joined from the pieces that
             # `scripts/ship.sh put` left in /tmp/ship (one call a piece, 26 in all, the machine kept
             # warm), checked against KNOWN_MODELS' sha256; the pair and n-gram rows (the costs line
             # first); the drafts-on-the-device A/B on random weights; the two shapes' token steps
             # kernel by kernel (what bounds the draft); the speculative GPU tests
             for key in qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
               read -r name sha < <(python3 -c "from pycalm.app.fetch import KNOWN_MODELS as K; m = K['$key']; print(m.name, m.sha256)")
               bash scripts/ship.sh join "$name" "$sha" "/tmp/$name" || exit 1
             done
             python3 scripts/bench_speculative.py /tmp/Qwen2.5-Coder-1.5B-Instruct.gguf --device gpu \
               --draft-model /tmp/Qwen2.5-Coder-0.5B-Instruct.gguf --drafter ngram,draft --draft-dtype q8 \
               --k adaptive --draft-k 7,8,adaptive --prompts 3 --new 64 2>&1 | tee "$out/bench_speculative.log" | grep -v "^  "
             # the draft in q4: fewer bytes a draft step, at the acceptance the CPU engine measures for it
             python3 scripts/bench_speculative.py /tmp/Qwen2.5-Coder-1.5B-Instruct.gguf --device gpu \
               --draft-model /tmp/Qwen2.5-Coder-0.5B-Instruct.gguf --drafter draft --draft-dtype q4 --tasks code \
               --k 7,8,adaptive --prompts 3 --new 64 2>&1 | tee -a "$out/bench_speculative.log" | grep -v "^  "
             python3 scripts/speculative_chain.py 2>&1 | tee "$out/speculative_chain.log" | tail -9
             python3 scripts/bench.py --shapes qwen2.5-0.5b,qwen2.5-1.5b --dtypes q4,q8,fp16 --tokens 64 2>&1 \
               | tee "$out/bench_qwen.log" | tail -30
             PYCALM_TEST_GPU=1 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_speculative.py tests/test_prefill.py \
               tests/test_eos_options.py -k "not real_model and not server" 2>&1 | tee "$out/tests_speculative.log" | tail -4 ;;
    pair)    # issue 30's acceptance rows alone (the first, about 110 s on a fresh H100 after the 26
             # ship.sh puts): the GPU tests of what they run (short prompts' cache-only passes,
             # drafts on the device, the loop), the pair at k = 7 and adaptive on every task, then
             # n-gram lookup (adaptive) on the 0.5B, then the pass profile
             PYCALM_TEST_GPU=1 python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_prefill.py tests/test_speculative.py \
               -k "short_prompt or draft_tokens or cache_only or gpu_speculative or span or prepare_captures" 2>&1 | tee "$out/tests_pair.log" | tail -3
             for key in qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
               read -r name sha < <(python3 -c "from pycalm.app.fetch import KNOWN_MODELS as K; m = K['$key']; print(m.name, m.sha256)")
               bash scripts/ship.sh join "$name" "$sha" "/tmp/$name" || exit 1
             done
             python3 scripts/bench_speculative.py /tmp/Qwen2.5-Coder-1.5B-Instruct.gguf --device gpu \
               --draft-model /tmp/Qwen2.5-Coder-0.5B-Instruct.gguf --drafter draft --draft-dtype q8 --k 7,adaptive \
               --tasks code,chat,grounded --prompts 3 --new 64 2>&1 | tee "$out/bench_pair.log" | grep -v "^  "
             python3 scripts/bench_speculative.py /tmp/Qwen2.5-Coder-0.5B-Instruct.gguf --device gpu --drafter ngram \
               --k adaptive --tasks grounded,chat,code --prompts 3 --new 64 2>&1 | tee -a "$out/bench_pair.log" | grep -v "^  "
             # the pass profile with and without the draft step beside the pass (does it slow the pass?)
             python3 scripts/speculative_profile.py /tmp/Qwen2.5-Coder-1.5B-Instruct.gguf \
               /tmp/Qwen2.5-Coder-0.5B-Instruct.gguf --beside on,off 2>&1 | tee "$out/speculative_profile.log" | grep -v "arn" ;;
    serve-musts)  # issue 31's acceptance rows alone (about 250 s on an H100): fp16 at 1 to 128 streams,
             # one greedy stream (the token step's tok/s is greedy), q8 and q4 at 32 and 64, and
             # fp16 with 1,000-token prompts at 32 and 64
             python3 scripts/bench_serve.py --streams 1,8,32,64,128 --shape llama3-8b --dtype fp16 2>&1 \
               | tee "$out/bench_serve.log" | tail -7
             python3 scripts/bench_serve.py --streams 1 --temperature 0 --shape llama3-8b --dtype fp16 2>&1 \
               | tee -a "$out/bench_serve.log" | tail -1
             for dtype in q8 q4; do
               python3 scripts/bench_serve.py --streams 32,64 --shape llama3-8b --dtype $dtype 2>&1 \
                 | tee -a "$out/bench_serve.log" | tail -2
             done
             python3 scripts/bench_serve.py --streams 32,64 --prompt 1000 --shape llama3-8b --dtype fp16 2>&1 \
               | tee -a "$out/bench_serve.log" | tail -2 ;;
    wgmma)   # Hopper's warpgroup intrinsics on the GPU (first the descriptor model, byte by byte), then the
             # wgmma matmul versions against the shipped tile and cuBLAS
             python3 scripts/kernels/wgmma_probe.py 2>&1 | tee "$out/wgmma_probe.log" | tail -16
             PYCALM_TEST_GPU=1 python3 -m pytest -q -n 0 -p no:cacheprovider tests/test_warpgroup.py tests/test_tma.py -m "not compile" -k "not script_checks" 2>&1 \
               | tee "$out/tests_warpgroup.log" | tail -8
             python3 scripts/kernels/matmul.py --wgmma w1,w2,w3,t1,t2,t3 --torch --budget 400 2>&1 | tee "$out/kernels_wgmma.log" | tail -40 ;;
    decode)  # the wgmma versions of the other formats: w1 (its warps decode) against d1 / d2 (a producer
             # warpgroup decodes; d2's codes come by TMA), checked on the GPU, then timed beside the tile
             python3 scripts/kernels/matmul.py --wgmma w1,d1,d2 --dtypes fp8,gf4,q8,q4 --budget 420 2>&1 \
               | tee "$out/kernels_decode.log" | grep -v " ok$" | tail -40 ;;
    wgmma-rows)  # the prefill attention on wgmma beside the shipped kernel; the wgmma rows versions, checked,
             # then timed at 16 / 32 / 64 rows beside skinny and the split tile
             python3 scripts/kernels/prefill_attention.py --variants shipped,wg,wg2 --rows 2048,4000 2>&1 \
               | tee "$out/kernels_prefill_attention_wg.log" | grep -A12 "=== summary"
             timeout 480 python3 scripts/kernels/rows_matmul.py --wgmma r1,r2,r3 --splits 2,4,8 --dtypes fp16,q4,q8,fp8,gf4 2>&1 \
               | tee "$out/kernels_wgmma_rows.log" | grep -E "check|FAIL|layer" ;;
    sweep)   dtypes=${steps[$i]}; i=$((i + 1))  # the matvec R x U x warps sweep, e.g. q4,gf4
             python3 scripts/kernels/matvec.py --sweep "$dtypes" 2>&1 | tee "$out/sweep.log" | tail -20 ;;
    cache-out)  # this tree's compiled kernels, for .kcache/ (see the header)
             names=$(python3 -c "from pycalm.gpu import kernel_cache as c; print(*(f.name for f in c.folders() if f.is_dir()))") || exit 1
             # shellcheck disable=SC2086  # the folder names: one word each
             tar -C "$kernels_root" -cf - $names | xz -T0 -6 | split -b 15m -d - "$out/kernels.tar.xz."
             echo "kernel cache: $(cd "$kernels_root" && find $names -name '*.nbc' | wc -l) kernels in" \
               "$(du -ch "$out"/kernels.tar.xz.* | tail -1 | cut -f1) ($(ls "$out"/kernels.tar.xz.* | wc -l) parts)" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
