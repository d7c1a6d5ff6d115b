#!/usr/bin/env bash
# Runs on the GPU machine (an H200 here): everything at once, results under $OUT.
#   - the oracle-vs-transformers fixture (tiny synthetic safetensors model, made here);
#   - the full-size synthetic qwen3-30b-a3b GGUF (~17 GB, generated here, never carried);
#   - parity of the GPU backend against the oracle on it (3 prompts x 32 tokens);
#   - decode benchmarks: folded vs per-token, warm-up apart, median and min-max.
# Needs: target/release/nibble built on the dev machine and carried; .gl/ (Vulkan loader debs)
# carried; vendor/qwen3-tokenizer carried. Usage: OUT=/some/dir scripts/gpu-bench.sh [steps]
# where steps is a comma list of: fixture,synth,kernels,hot,kbab,kbonly,moetune,parity,sampled,bench,profile,routerab,ab,abx,prefillx,ksplitab,lone,prefill,coop,qtiles,splits,prefillprof,combineab,splitab,flagsets,gputests,batch,dbufab,
# cpu,fold,numerics,numab,depth16k,load,mlx,mlxpre,q8,mlx8,q6k,q4k,q4km,q5km,kprof,grammar,ppl,pplab,yarn,kvcache,kvdeep,kbattn
# (default: fixture,synth,kernels,parity,bench,profile,fold,numerics,depth16k).
# `kernels` needs target/release/examples/kernel_bench carried too; `load` needs the server's load
# test binary as target/release/load-test (`cargo test --release -p nibble-server --test load
# --no-run`, then copy the executable it names).
set -uo pipefail
# Every step's `timeout` stays in the script's process group (--foreground), so a timeout around
# the whole script (the device call's) also stops the bench a step is running: a plain `timeout`
# leads a group of its own, and its bench outlived the script and held the GPU's memory (run 156).
timeout() { command timeout --foreground "$@"; }
cd "$(dirname "$0")/.."
OUT="${OUT:?set OUT}"
# A subfolder of the call's $OUT (e.g. OUT=$OUT/a for a second step list) may not exist yet.
mkdir -p "$OUT"
STEPS="${1:-fixture,synth,kernels,parity,bench,profile,fold,numerics,depth16k}"
has() { [[ ",$STEPS," == *",$1,"* ]]; }
for f in .gl/*.deb; do dpkg -x "$f" / 2>/dev/null; done
ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export XDG_RUNTIME_DIR=/tmp
N="${NIBBLE_BIN:-target/release/nibble}"
TOK=vendor/qwen3-tokenizer/tokenizer.json
MODEL=/tmp/q30.gguf
S="$OUT/summary.txt"
say() { echo "== $*" | tee -a "$S"; }
say "date $(date -u +%FT%TZ) commit $(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$S"
nproc | sed 's/^/cpus /' | tee -a "$S"
# GPU clocks, power and load every 200 ms while the steps run ($OUT/clocks.csv): whether the
# latency-bound decode runs at full SM clock (set CLOCKS=0 to skip).
if [[ "${CLOCKS:-1}" != 0 ]]; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu \
    --format=csv -lms 200 > "$OUT/clocks.csv" 2>&1 &
  CLOCKS_PID=$!
  trap 'kill $CLOCKS_PID 2>/dev/null' EXIT
fi

if has fixture; then
  say "oracle fixture"
  $N synth --preset tiny --format safetensors --seed 0 -o /tmp/tiny-hf --quiet 2>&1 | tee -a "$S"
  PYTHONUNBUFFERED=1 python3 scripts/oracle_fixture.py --model /tmp/tiny-hf --out "$OUT/oracle_hf.json" 2>&1 | tail -3 | tee -a "$S"
  # The same model with YaRN (x4 over 1024 positions; max_position_embeddings 4096 = 4 x 1024,
  # so transformers releases that take the ratio for the factor agree too).
  $N synth --preset tiny --format safetensors --seed 0 --rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 1024 -o /tmp/tiny-hf-yarn --quiet 2>&1 | tee -a "$S"
  PYTHONUNBUFFERED=1 python3 scripts/oracle_fixture.py --model /tmp/tiny-hf-yarn --out "$OUT/oracle_hf_yarn.json" \
    --synth "nibble synth --preset tiny --format safetensors --seed 0 --rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 1024" 2>&1 | tail -3 | tee -a "$S"
fi
if has synth || has parity || has sampled || has grammar || has ppl || has pplab || has yarn || has kvcache || has kvdeep || has bench || has profile || has routerab || (has ab && [ -z "${AB_QUANT:-}" ]) || has abx || has prefillx || has ksplitab || has dbufab || has lone || has coop || has qtiles || has splits || has combineab || has splitab || (has flagsets && [ -z "${FS_QUANT:-}" ]) || has prefill || has prefillprof || has batch || has mlx || has cpu || has fold || has numerics || has numab || has depth16k || has load; then
  say "synth qwen3-30b-a3b"
  [ -s $MODEL ] && say "(model already present from an earlier call on this warm machine)" || /usr/bin/time -f "synth wall %e s, max RSS %M KB" $N synth --preset qwen3-30b-a3b --seed 0 --tokenizer "$TOK" -o $MODEL --quiet 2>&1 | tee -a "$S"
  $N inspect $MODEL 2>&1 | tee -a "$S"
fi
if has parity; then
  # PARITY_SETS: ';'-separated extra flag sets, each checked after the default (e.g.
  # "--tune late_norm=1"). The built-in prompts are under 32 tokens, so the default checks the
  # column prefill; "--prefill-gemm-min 2" (the default extra set) sends them through the GEMM
  # prefill too. PARITY_DEFAULT=0 skips the default set (a change to the GEMM prefill only).
  IFS=';' read -ra PSETS <<< "${PARITY_SETS---prefill-gemm-min 2}"
  [[ "${PARITY_DEFAULT:-1}" == 0 ]] || PSETS=("" "${PSETS[@]}")
  for ps in "${PSETS[@]}"; do
    say "parity gpu vs oracle (3 built-in prompts x 32 tokens) [${ps:-default}]"
    timeout 300 $N parity -m $MODEL --backend gpu -n 32 --ctx 512 -v $ps 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
  done
fi
if has kernels; then
  say "kernel microbenchmark (pos 512)"
  # The first invocation on an idle GPU runs at low clocks (empty dispatch ~5 us instead of ~1.7):
  # a discarded warm-up invocation first.
  timeout 120 target/release/examples/kernel_bench --shapes full --pos 512 --reps 2 > /dev/null 2>&1
  timeout 120 target/release/examples/kernel_bench --shapes full --pos 512 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
fi
if has hot; then
  # The same kernels with every weight read from L2 (--hot: one copy, one MoE route) against the
  # usual streamed-from-memory rows: what prefetching a kernel's weights could buy at most.
  say "kernel microbenchmark (pos 128): cold (streamed) then --hot (L2-resident weights)"
  timeout 120 target/release/examples/kernel_bench --shapes full --pos 128 --reps 2 > /dev/null 2>&1
  timeout 120 target/release/examples/kernel_bench --shapes full --pos 128 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
  timeout 120 target/release/examples/kernel_bench --shapes full --pos 128 --hot 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
fi
if has kbab; then
  # A/B of kernel_bench builds: every target/ab/kb-* (built here from each variant), pos 128,
  # two interleaved rounds after a discarded warm-up; the per-call rows only.
  timeout 120 "$(ls target/ab/kb-* | head -1)" --shapes full --pos 128 --reps 2 > /dev/null 2>&1
  # KB_POS: the positions (space-separated; default 128), each its own pair of rounds.
  for pos in ${KB_POS:-128}; do
    for round in 1 2; do
      for b in target/ab/kb-*; do
        say "kbab pos $pos round $round: $(basename $b)"
        timeout 120 $b --shapes full --pos $pos ${KB_ARGS:-} 2>&1 | grep -E "^  " | grep -v -E "cols|tuning|int8|matmul (qkv|o_proj)| r[124] " | tee -a "$S"
      done
    done
  done
fi
if has kbattn; then
  # The attention rows of kernel_bench (every split, tile and form it builds, the streamed form
  # included) at positions 1, 512, 4096 and KBA_POS (default 16384), two rounds after a
  # discarded warm-up. Needs target/release/examples/kernel_bench.
  KB=target/release/examples/kernel_bench
  timeout 120 $KB --shapes full --pos ${KBA_POS:-16384} --only "attention" --reps 2 > /dev/null 2>&1
  for round in 1 2; do
    say "kbattn round $round (pos 1, 512, 4096, ${KBA_POS:-16384})"
    timeout 200 $KB --shapes full --pos ${KBA_POS:-16384} --only "attention" 2>&1 | grep -E "^  |^\* " | tee -a "$S"
  done
fi
if has kbonly; then
  # The rows of every target/ab/kb-* build whose names contain KB_ONLY (e.g. "@pos 4096": the
  # attention rows there), two interleaved rounds: quick A/Bs of one kernel's variants. kb-* may
  # be wrapper scripts (an env variable or --hot for one build). A discarded warm-up first (the
  # first rows on an idle GPU run at low clocks).
  timeout 120 "$(ls target/ab/kb-* | head -1)" --shapes full --pos ${KB_POS:-512} --only "${KB_ONLY:?set KB_ONLY}" --reps 2 > /dev/null 2>&1
  for round in 1 2; do
    for b in target/ab/kb-*; do
      say "kbonly round $round: $(basename $b) [$KB_ONLY]"
      timeout 120 $b --shapes full --pos ${KB_POS:-512} --only "$KB_ONLY" 2>&1 | grep -E "^  " | tee -a "$S"
    done
  done
fi
if has moetune; then
  say "kernel microbenchmark: staged f32 MoE work splits (--moe-tunings)"
  timeout 200 target/release/examples/kernel_bench --shapes full --pos 512 --moe-tunings 2>&1 | grep -E "tuning|gate_up\+silu K=8 .* f32|down\+combine K=8 .* f32|adapter" | tee -a "$S"
fi
if has bench; then
  say "bench gpu (default numerics): tg128 at depth 0 and 4096, sampled (generate's and the server's lone-stream way), pp512, batch 1/2/4/8 (multi-stream), folded vs per-token"
  timeout 400 $N bench -m $MODEL --backend gpu -p 512 -n 128 --reps 5 --depth 0,4096 --sampled --batch 1,2,4,8 --compare-per-token --ctx 4700 --plot "$OUT/bench.svg" -v 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
fi
if has sampled; then
  # Sampled decoding on the full-size model: the oracle with the host's sampler against the GPU's
  # folded runs sampled on the device (llama.cpp's settings, seed 5), then the sampled bench rows
  # (folded on the device, host sampler per step, the server's lone stream, whole row).
  say "parity gpu vs oracle, greedy and sampled (seed 5), 3 built-in prompts x 16 tokens"
  timeout 400 $N parity -m $MODEL --backend gpu -n 16 --ctx 512 --sampled 5 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
  say "bench gpu: tg128 greedy and sampled (folded on the device / host sampler per step / lone stream / whole row)"
  timeout 300 $N bench -m $MODEL --backend gpu -p 0 -n 128 --reps 5 --sampled --ctx 512 -v 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
fi
if has grammar; then
  # What a request that needs each step's logits on the host costs against folded greedy runs:
  # `generate` decode tok/s (its stats line; 128 tokens, 3 rounds interleaved) greedy, with a
  # logit bias (host argmax of each row), and under a JSON schema (each row masked by the
  # grammar first; the noise model writes one long string).
  say "generate gpu: greedy folded / logit bias (host step) / JSON schema (host step + grammar mask), decode tok/s"
  SCHEMA='{"type":"object","properties":{"story":{"type":"string"}},"required":["story"]}'
  for r in 1 2 3; do
    for mode in greedy bias schema; do
      case $mode in
        greedy) extra=() ;;
        bias) extra=(--logit-bias 0-inf) ;;
        schema) extra=(-j "$SCHEMA") ;;
      esac
      line=$(timeout 200 $N generate -m $MODEL --backend gpu --ctx 512 -p "Write a long story." -n 128 "${extra[@]}" 2>&1 >/dev/null | grep "decode")
      echo "round $r $mode: $line" | tee -a "$S"
    done
  done
fi
if has ppl; then
  # Scoring a text (`nibble perplexity`, llama.cpp's protocol: every row of each window's
  # prefill through the lm_head): the repo's own docs as the text (no corpus can be fetched
  # there). First the full-size model's figure on the oracle against the GPU on one 64-token
  # window (the oracle steps token by token), then the GPU's throughput over 512-token windows
  # (the first window reported apart as warm-up).
  cat docs/BENCHMARKS.md ARCHITECTURE.md README.md docs/runs/*.txt > /tmp/ppl.txt 2>/dev/null
  say "perplexity: oracle vs gpu on one 64-token window of the full-size model"
  for b in ref gpu; do
    timeout 400 $N perplexity -m $MODEL --backend $b --ctx 64 --chunks 1 -f /tmp/ppl.txt --json 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
  done
  say "perplexity gpu: --ctx 512, 40 windows, then --ctx 2048, 8 windows"
  timeout 300 $N perplexity -m $MODEL --backend gpu --ctx 512 --chunks 40 -f /tmp/ppl.txt 2>&1 | grep -v XDG_RUNTIME | tail -3 | tee -a "$S"
  timeout 300 $N perplexity -m $MODEL --backend gpu --ctx 2048 --chunks 8 -f /tmp/ppl.txt 2>&1 | grep -v XDG_RUNTIME | tail -3 | tee -a "$S"
fi
if has yarn; then
  # Qwen's long-context recipe (YaRN x4 over 32768 positions) on the full-size model: greedy
  # parity with the oracle under the same flags, then decode from depth 65536 (past the
  # model's own 40960), the context the scaling opens.
  Y="--rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 32768"
  say "parity gpu vs oracle with $Y (3 built-in prompts x 32 tokens)"
  timeout 300 $N parity -m $MODEL --backend gpu -n 32 --ctx 512 -v $Y 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
  say "bench gpu with $Y: tg32 from depth 65536"
  timeout 400 $N bench -m $MODEL --backend gpu -p 0 -n 32 --reps 1 --depth 65536 --ctx 65600 $Y 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
fi
if has kvcache; then
  # The f16 KV cache (--cache-type f16) against the default f32: greedy parity with an oracle
  # holding an f16 cache too, then decode side by side (two interleaved rounds) from depths 0,
  # 4096 and 16384 (`kvdeep`: tg32 from depth 32768 once each).
  say "parity gpu vs oracle with --cache-type f16 (3 built-in prompts x 32 tokens)"
  timeout 300 $N parity -m $MODEL --backend gpu -n 32 --ctx 512 -v --cache-type f16 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
  for r in 1 2; do
    for t in f32 f16; do
      say "kvcache round $r: --cache-type $t, tg128 at depths 0, 4096, 16384"
      timeout 300 $N bench -m $MODEL --backend gpu -p 0 -n 128 --reps 3 --depth 0,4096,16384 --ctx 16600 --cache-type $t 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
    done
  done
fi
if has kvdeep; then
  for t in f32 f16; do
    say "kvcache: --cache-type $t, tg32 at depth 32768"
    timeout 300 $N bench -m $MODEL --backend gpu -p 0 -n 32 --reps 1 --depth 32768 --ctx 32900 --cache-type $t -v 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
  done
fi
if has pplab; then
  # Perplexity throughput of several builds side by side (each binary of $PPL_BINS, default
  # the carried one and every target/ab/nibble-*), two rounds interleaved, --ctx 512 and 2048.
  cat docs/BENCHMARKS.md ARCHITECTURE.md README.md docs/runs/*.txt > /tmp/ppl.txt 2>/dev/null
  for r in 1 2; do
    for bin in ${PPL_BINS:-$N target/ab/nibble-*}; do
      for c in "512 24" "2048 6"; do
        set -- $c
        line=$(timeout 200 $bin perplexity -m $MODEL --backend gpu --ctx $1 --chunks $2 -f /tmp/ppl.txt 2>/dev/null | tr '\n' ' ')
        echo "round $r $(basename $bin) ctx $1: $line" | tee -a "$S"
      done
    done
  done
fi
if has profile; then
  # Where one step's GPU time goes in the real plan (timestamps after every op), at three depths.
  say "bench gpu --profile 64,1024,4096: per-op GPU time of one greedy step"
  timeout 300 $N bench -m $MODEL --backend gpu -p 0 -n 128 --reps 3 --depth 0 --profile 64,1024,4096 --ctx 4200 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
fi
if has kprof; then
  # Per-op GPU time of one greedy step from position 64 for each GGUF block type in $KPROF_QUANTS
  # (default "q4_k_m q4_k": where the mixed file's decode loses against the pure one), each
  # written here from seed 0 and deleted after (disk). Each quant named in $KPROF_PARITY also
  # gets a greedy parity check against the oracle first (default prefills, 3 prompts x 32).
  for q in ${KPROF_QUANTS:-q4_k_m q4_k}; do
    f=/tmp/q30-prof-$q.gguf
    say "bench gpu --profile 64 on the $q model"
    $N synth --preset qwen3-30b-a3b --quant $q --seed 0 --tokenizer "$TOK" -o $f --quiet 2>&1 | tee -a "$S"
    if [[ " ${KPROF_PARITY:-} " == *" $q "* ]]; then
      say "parity gpu vs oracle on the $q model [default] (3 built-in prompts x 32 tokens)"
      timeout 300 $N parity -m $f --backend gpu -n 32 --ctx 512 -v 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
    fi
    timeout 200 $N bench -m $f --backend gpu -p 0 -n 64 --reps 3 --depth 0 --profile 64 --ctx 512 -v 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
    rm -f $f
  done
fi
if has routerab; then
  # The same bench with the router in its own dispatch (--router-dispatch): the A/B of the router
  # fold (kernels/router_fold.rs); compare with the bench step's single-stream rows.
  say "bench gpu --router-dispatch (router not folded): tg128 at depth 0 and 4096, pp512"
  timeout 300 $N bench -m $MODEL --backend gpu --router-dispatch -p 512 -n 128 --reps 5 --depth 0,4096 --ctx 4700 -v 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
  say "bench gpu (router folded, the default): tg128 at depth 0 and 4096, pp512"
  timeout 300 $N bench -m $MODEL --backend gpu -p 512 -n 128 --reps 5 --depth 0,4096 --ctx 4700 -v 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
fi
if has ab; then
  # A/B of builds: every binary carried in target/ab/ (e.g. nibble-<n>-<commit>, built on the
  # development machine from each commit by scripts/ab-build.sh), tg128 and pp512 (or the bench arguments in AB_ARGS), two rounds interleaved so
  # drift hits all alike. On the Q4_0 model, or with AB_QUANT (e.g. q4_k_m) on a model of that
  # type written here as /tmp/q30-ab-$AB_QUANT.gguf (AB_MODEL: another path, kept for the steps
  # after, e.g. /tmp/q30-q4km.gguf for q4km). AB_ROUNDS: rounds other than 2 (1 for a short
  # call). Rounds catch drift, not what a build changes besides its GPU work: one that did the
  # same work moved tg128 by -1.2% on Q4_0 and +1.5% on Q4_K_M (runs 158-159), so read build
  # differences under ~2% on one file as unsettled.
  AM=$MODEL
  if [ -n "${AB_QUANT:-}" ]; then
    AM=${AB_MODEL:-/tmp/q30-ab-$AB_QUANT.gguf}
    say "synth qwen3-30b-a3b --quant $AB_QUANT for the A/B: $AM"
    [ -s $AM ] || $N synth --preset qwen3-30b-a3b --quant $AB_QUANT --seed 0 --tokenizer "$TOK" -o $AM --quiet 2>&1 | tee -a "$S"
  fi
  for round in $(seq 1 ${AB_ROUNDS:-2}); do
    for b in target/ab/nibble-*; do
      say "ab round $round: $(basename $b) tg128"
      timeout 150 $b bench -m $AM --backend gpu ${AB_ARGS:--p 512 -n 128 --reps 3 --depth 0 --ctx 1024} 2>&1 | grep -E "^tg|^pp" | tee -a "$S"
    done
  done
fi
if has abx; then
  # The ab step over several bench argument sets: every target/ab/nibble-* (a binary, or a
  # wrapper script setting an environment variable) with each ';'-separated set of AB_SETS,
  # two rounds interleaved so drift hits all alike.
  IFS=';' read -ra XSETS <<< "${AB_SETS:?set AB_SETS}"
  for round in 1 2; do
    for b in target/ab/nibble-*; do
      for args in "${XSETS[@]}"; do
        say "abx round $round: $(basename $b) $args"
        timeout 200 $b bench -m $MODEL --backend gpu $args 2>&1 | grep -E "^tg|^pp|^batch|aggregate" | tee -a "$S"
      done
    done
  done
fi
if has prefillx; then
  # Short prompts: the GEMM prefill (--prefill-gemm-min 2) against the column prefill
  # (--prefill-chunk 0), two rounds interleaved (PX_LENS: prompt lengths). Where they cross sets
  # GEMM_PREFILL_MIN_TOKENS (crates/gpu/src/backend_prefill.rs; prompts below it take the
  # column prefill).
  for round in 1 2; do
    for p in ${PX_LENS:-8 16 32 64 128}; do
      for mode in "--prefill-gemm-min 2" "--prefill-chunk 0"; do
        say "prefillx round $round: pp$p [$mode]"
        timeout 120 $N bench -m $MODEL --backend gpu $mode -p $p -n 4 --reps 5 --ctx 512 2>&1 | grep -E "^pp" | tee -a "$S"
      done
    done
  done
fi
# The default build against itself with one comparison flag, two interleaved rounds so drift
# hits both alike: flag_ab STEP LABEL-DEFAULT LABEL-FLAG FLAG BENCH-ARGS...
flag_ab() {
  local step=$1 dflt=$2 alt=$3 flag=$4; shift 4
  for round in 1 2; do
    for mode in "$dflt" "$alt"; do
      say "$step round $round: $mode"
      extra=""; [ "$mode" = "$alt" ] && extra="$flag"
      timeout 200 $N bench -m $MODEL --backend gpu $extra "$@" 2>&1 | grep -E "^tg|^pp" | tee -a "$S"
    done
  done
}
if has ksplitab; then
  # A short chunk's qkv / o-proj in K splits (the default, 8) against unsplit (--tune
  # prefill_ksplits=1), at KS_LENS prompt lengths.
  for p in ${KS_LENS:-64 128 255}; do
    flag_ab ksplitab "8 K splits pp$p" "unsplit pp$p" "--tune prefill_ksplits=1" -p $p -n 4 --reps 5 --ctx 512
  done
fi
if has dbufab; then
  # The matrix-unit GEMM's 32-token tiles (the MoE expert GEMMs, short dense chunks) with two
  # staging buffers, one barrier per block (the default since run 133) against one buffer
  # (--tune prefill_dbuf=0; the gputests step's GEMM and MoE tests run both forms), at DB_LENS
  # (pp128: the short chunk's split dense GEMMs and the experts on 32-token tiles; pp512: the
  # experts only; from about 1024 tokens every tile is 64 tokens tall, so the flag does nothing).
  for p in ${DB_LENS:-128 512}; do
    flag_ab dbufab "two staging buffers pp$p" "one staging buffer pp$p" "--tune prefill_dbuf=0" -p $p -n 4 --reps 3 --ctx $((p + 64))
  done
fi
if has lone; then
  # A lone multi-stream sequence (what a single user of `nibble serve` gets) on the
  # single-sequence plan in its KV slot (the default) against the column kernels
  # (--columns-alone); the single-stream tg128 row comes with each.
  flag_ab lone "batch 1 on the plan" "batch 1 on the columns" --columns-alone -p 0 -n 128 --reps 3 --batch 1,2 --ctx 512
fi
if has prefill; then
  # The GEMM prefill (the default) against the column prefill (--prefill-chunk 0), pp512 at
  # depth 0 and 4096, two interleaved rounds; then the chunk length swept on a 2048-token prompt.
  flag_ab prefill "gemm prefill" "column prefill" "--prefill-chunk 0" -p 512 -n 16 --reps 3 --depth 0,4096 --ctx 4700
  for c in ${PREFILL_CHUNKS:-128 256 512 1024 2048}; do
    say "prefill chunk $c: pp2048"
    timeout 200 $N bench -m $MODEL --backend gpu --prefill-chunk $c -p 2048 -n 16 --reps 3 --ctx 2200 2>&1 | grep -E "^tg|^pp" | tee -a "$S"
  done
fi
if has coop; then
  # The GEMM prefill's int4 products on matrix units (kernels/gemm_coop.rs, the default where the
  # device offers 16x16x16 f16 cooperative matrices) against the f32-fma kernel
  # (--prefill-f32-gemm): pp512 at depth 0 and 4096 in two interleaved rounds, then pp2048 once each.
  # COOP_QUICK=1: one round at depth 0 only (a short call).
  if [[ "${COOP_QUICK:-0}" == 1 ]]; then
    for mode in "" --prefill-f32-gemm; do
      say "coop pp512: ${mode:-gemm on matrix units}"
      timeout 200 $N bench -m $MODEL --backend gpu $mode -p 512 -n 16 --reps 3 --ctx 1024 -v 2>&1 | grep -E "^tg|^pp|prefill:" | tee -a "$S"
    done
  else
    flag_ab coop "gemm on matrix units" "gemm on f32 fmas" --prefill-f32-gemm -p 512 -n 16 --reps 3 --depth 0,4096 --ctx 4700
  fi
  for mode in "" --prefill-f32-gemm; do
    say "coop pp2048: ${mode:-gemm on matrix units}"
    timeout 200 $N bench -m $MODEL --backend gpu $mode -p 2048 -n 16 --reps 3 --ctx 2200 2>&1 | grep -E "^tg|^pp" | tee -a "$S"
  done
fi
if has qtiles; then
  # The prefill's query-tile attention (the default, kernels/attention_prefill.rs) against the
  # column attention (--prefill-column-attention): pp512 at depth 0 and 4096 and pp2048, one
  # round each (QT_ROUNDS for more), then a 2048-token chunk's profile with the tiles.
  for round in $(seq 1 ${QT_ROUNDS:-1}); do
    for mode in --prefill-column-attention ""; do
      say "qtiles round $round: ${mode:-query tiles (default)}"
      timeout 200 $N bench -m $MODEL --backend gpu $mode -p 512 -n 4 --reps 3 --depth 0,4096 --ctx 4700 2>&1 | grep -E "^pp" | tee -a "$S"
      timeout 200 $N bench -m $MODEL --backend gpu $mode -p 2048 -n 4 --reps 3 --ctx 2200 2>&1 | grep -E "^pp" | tee -a "$S"
    done
  done
  say "prefill profile with query tiles: one chunk of 2048 tokens"
  timeout 200 $N bench -m $MODEL --backend gpu --prefill-chunk 2048 -p 2048 -n 4 --reps 2 --ctx 2112 --profile-prefill 2048 2>&1 | grep -E "^pp|prefill profile|calls" | tee -a "$S"
fi
if has splits; then
  # The query-tile attention's key splits (kernels/attention_prefill.rs) against none
  # (`--tune prefill_splits=1`): short prompts deep in the context, where the tiles alone
  # leave most of the GPU idle, and pp512 at depth 4096.
  for mode in "--tune prefill_splits=1" ""; do
    say "splits: ${mode:-default splits}"
    timeout 200 $N bench -m $MODEL --backend gpu $mode -p 64 -n 4 --reps 5 --depth 0,4096 --ctx 4700 2>&1 | grep -E "^pp" | tee -a "$S"
    timeout 200 $N bench -m $MODEL --backend gpu $mode -p 512 -n 4 --reps 3 --depth 4096 --ctx 4700 2>&1 | grep -E "^pp" | tee -a "$S"
  done
fi
if has prefillprof; then
  # Where a prefill chunk's GPU time goes, op by op over the layers (--profile-prefill), at the
  # chunk lengths of PREFILL_PROF (default 128 512 2048), each chunk one prompt from position 0.
  for c in ${PREFILL_PROF:-128 512 2048}; do
    say "prefill profile: one chunk of $c tokens"
    timeout 200 $N bench -m $MODEL --backend gpu --prefill-chunk $c -p $c -n 4 --reps 2 --ctx $((c + 64)) --profile-prefill $c 2>&1 | grep -E "^pp|prefill profile|calls" | tee -a "$S"
  done
fi
if has combineab; then
  # The attention's chunk merge: in the last chunk workgroup of each kv head (fused, the default
  # on Vulkan) against its own dispatch (--combine-dispatch); tg128 at depth 0 and 4096 by
  # default (CAB_ARGS: other bench arguments).
  flag_ab combineab "attention combine fused" "attention combine dispatch" --combine-dispatch ${CAB_ARGS:--p 0 -n 128 --reps 3 --depth 0,4096 --ctx 4300}
fi
if has splitab; then
  # The MoE down kernel's slot groups: the default (4 on Vulkan: each row block's 8 slots over
  # four workgroups, the last adds their sums) against one workgroup per row block
  # (--tune down_split=1); single-stream tg128 and the multi-stream columns (SAB_ARGS: other
  # bench arguments).
  flag_ab splitab "down slot groups 4" "down slot groups 1" "--tune down_split=1" ${SAB_ARGS:--p 512 -n 128 --reps 3 --batch 1,4,8 --ctx 1024}
fi
if has flagsets; then
  # The default build bare and with each ';'-separated flag set of FLAGSETS (e.g.
  # "--tune o_rows=1;--tune down_split=8"), two interleaved rounds (FS_ARGS: bench arguments).
  # On the Q4_0 model, or with FS_QUANT (e.g. q4_k_m) on a model of that type written here as
  # /tmp/q30-fs-$FS_QUANT.gguf (kept for the steps after).
  IFS=';' read -ra SETS <<< "${FLAGSETS:?set FLAGSETS}"
  FM=$MODEL
  if [ -n "${FS_QUANT:-}" ]; then
    FM=/tmp/q30-fs-$FS_QUANT.gguf
    say "synth qwen3-30b-a3b --quant $FS_QUANT for the flag sets: $FM"
    [ -s $FM ] || $N synth --preset qwen3-30b-a3b --quant $FS_QUANT --seed 0 --tokenizer "$TOK" -o $FM --quiet 2>&1 | tee -a "$S"
  fi
  for round in 1 2; do
    for fs in "" "${SETS[@]}"; do
      say "flagsets round $round: [${fs:-default}]"
      timeout 150 $N bench -m $FM --backend gpu $fs ${FS_ARGS:--p 0 -n 128 --reps 3 --ctx 512} 2>&1 | grep -E "^tg|^pp" | tee -a "$S"
    done
  done
fi
if has gputests; then
  # The GPU crate's own tests (CI runs them on lavapipe) on this GPU, those whose names match
  # CT_FILTER (default: all), then the ignored diagnostics matching CT_DIAG (if set), with their
  # output. Needs the test binary as target/release/gpu-tests (`cargo test --release -p
  # nibble-gpu --lib --no-run`, then copy the executable it names).
  say "gpu crate tests on the NVIDIA adapter: filter '${CT_FILTER:-}'"
  NIBBLE_TEST_ADAPTER=nvidia timeout 400 target/release/gpu-tests ${CT_FILTER:-} --test-threads 1 2>&1 | grep -vE "XDG_RUNTIME|^$" | tail -20 | tee -a "$S"
  if [[ -n "${CT_DIAG:-}" ]]; then
    say "gpu crate diagnostics on the NVIDIA adapter: '$CT_DIAG'"
    NIBBLE_TEST_ADAPTER=nvidia timeout 200 target/release/gpu-tests $CT_DIAG --ignored --nocapture --test-threads 1 2>&1 | grep -vE "XDG_RUNTIME|^$" | tail -20 | tee -a "$S"
  fi
fi
if has mlx; then
  # The same seed as an MLX checkpoint (mlx-lm's affine 4-bit groups of 64, 8-bit routers),
  # written here: open time and peak memory (the interleave at open), greedy parity of the GPU
  # backend against the oracle on it, and decode against the Q4_0 GGUF of the same seed, two
  # rounds interleaved.
  MLX=/tmp/q30-mlx
  say "synth qwen3-30b-a3b --format mlx"
  [ -s $MLX/config.json ] || /usr/bin/time -f "synth mlx wall %e s, max RSS %M KB" $N synth --preset qwen3-30b-a3b --format mlx --seed 0 --tokenizer "$TOK" -o $MLX --quiet 2>&1 | tee -a "$S"
  du -sh $MLX | tee -a "$S"
  for m in $MODEL $MLX; do
    say "open + 1 token on the GPU: $m"
    /usr/bin/time -f "wall %e s, max RSS %M KB" $N generate -m $m --backend gpu -n 1 -p Hi --ctx 512 2>&1 | grep -E "wall|error" | tee -a "$S"
  done
  say "parity gpu vs oracle on the MLX checkpoint (3 built-in prompts x 32 tokens)"
  timeout 400 $N parity -m $MLX --backend gpu -n 32 --ctx 512 -v 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
  for round in $(seq ${MLX_ROUNDS:-2}); do
    for m in $MODEL $MLX; do
      say "mlx round $round: $m"
      timeout 200 $N bench -m $m --backend gpu -p 128 -n 128 --reps 3 --ctx 512 2>&1 | grep -E "^tg|^pp|^warm" | tee -a "$S"
    done
  done
fi
if has mlxpre; then
  # MLX prompts through the GEMM prefill (session 31): the MLX checkpoint alone (no Q4_0 file),
  # open time and peak memory, greedy parity with every prompt through the GEMM prefill (the
  # matrix units where present), then pp${MLX_P:-512} on the matrix units, on f32 fmas and
  # through the columns, MLX_ROUNDS rounds interleaved.
  MLX=/tmp/q30-mlx
  say "synth qwen3-30b-a3b --format mlx"
  [ -s $MLX/config.json ] || /usr/bin/time -f "synth mlx wall %e s, max RSS %M KB" $N synth --preset qwen3-30b-a3b --format mlx --seed 0 --tokenizer "$TOK" -o $MLX --quiet 2>&1 | tee -a "$S"
  say "open + 1 token on the GPU: $MLX"
  /usr/bin/time -f "wall %e s, max RSS %M KB" $N generate -m $MLX --backend gpu -n 1 -p Hi --ctx 512 2>&1 | grep -E "wall|error" | tee -a "$S"
  # MLX_PARITY_SETS: ';'-separated flag sets (default: every prompt through the GEMM prefill),
  # MLX_PN tokens each (default 32); MLX_SETS: the prefill forms to time (default: matrix units,
  # f32 fmas, columns).
  IFS=';' read -ra MPS <<< "${MLX_PARITY_SETS---prefill-gemm-min 2}"
  for ps in "${MPS[@]}"; do
    say "parity gpu vs oracle on the MLX checkpoint [$ps] (3 built-in prompts x ${MLX_PN:-32} tokens)"
    timeout 300 $N parity -m $MLX --backend gpu -n ${MLX_PN:-32} --ctx 1024 -v $ps 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
  done
  IFS=';' read -ra MSETS <<< "${MLX_SETS-;--prefill-f32-gemm;--prefill-chunk 0}"
  for round in $(seq ${MLX_ROUNDS:-1}); do
    for fs in "${MSETS[@]}"; do
      say "mlx prefill round $round: [${fs:-default}]"
      timeout 150 $N bench -m $MLX --backend gpu $fs -p ${MLX_P:-512} -n 32 --reps 3 --ctx 1024 2>&1 | grep -E "^tg|^pp" | tee -a "$S"
    done
  done
fi
# A GGUF of another block type on the GPU: the full-size model written here with `synth --quant
# $1` to $2, open time and peak memory, greedy parity against the oracle, then decode and
# prefill. Knobs, prefixed by $3 (Q8, Q6 or Q4K): _VS_Q4=1 also writes the Q4_0 GGUF of the same
# seed and benches it beside, in each of _ROUNDS rounds; _SETS: ';'-separated extra flag sets
# benched after the default (e.g. "--prefill-chunk 0", the column prefill); _PARITY_SETS: flag
# sets of the parity check (default: the default set, then every prompt through the GEMM
# prefill), _PN tokens each within _PT seconds; _CPU_PARITY=1: the CPU backend's parity first;
# _P: the bench's prompt length.
gguf_quant_step() {
  local quant=$1 file=$2 k=$3
  local vs="${k}_VS_Q4" rounds="${k}_ROUNDS" sets="${k}_SETS" psets="${k}_PARITY_SETS" pn="${k}_PN" pt="${k}_PT" pp="${k}_P"
  say "synth qwen3-30b-a3b --quant $quant"
  [ -s $file ] || /usr/bin/time -f "synth $quant wall %e s, max RSS %M KB" $N synth --preset qwen3-30b-a3b --quant $quant --seed 0 --tokenizer "$TOK" -o $file --quiet 2>&1 | tee -a "$S"
  ls -l $file | tee -a "$S"
  local models=($file)
  if [[ "${!vs:-0}" == 1 ]]; then
    [ -s $MODEL ] || /usr/bin/time -f "synth wall %e s, max RSS %M KB" $N synth --preset qwen3-30b-a3b --seed 0 --tokenizer "$TOK" -o $MODEL --quiet 2>&1 | tee -a "$S"
    models=($file $MODEL)
  fi
  say "open + 1 token on the GPU: $file"
  /usr/bin/time -f "wall %e s, max RSS %M KB" $N generate -m $file --backend gpu -n 1 -p Hi --ctx 512 -v 2>&1 | grep -E "wall|error|resident|prefill|weights" | tee -a "$S"
  local ps fs m round cpu="${k}_CPU_PARITY"
  if [[ "${!cpu:-0}" == 1 ]]; then
    say "parity cpu vs oracle on the $quant model (3 built-in prompts x ${!pn:-32} tokens)"
    timeout ${!pt:-300} $N parity -m $file --backend cpu -n ${!pn:-32} --ctx 512 -v 2>&1 | tee -a "$S"
  fi
  IFS=';' read -ra QPS <<< "${!psets-;--prefill-gemm-min 2}"
  for ps in "${QPS[@]}"; do
    say "parity gpu vs oracle on the $quant model [${ps:-default}] (3 built-in prompts x ${!pn:-32} tokens)"
    timeout ${!pt:-300} $N parity -m $file --backend gpu -n ${!pn:-32} --ctx 512 -v $ps 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
  done
  for round in $(seq ${!rounds:-1}); do
    for m in "${models[@]}"; do
      say "$quant round $round: $m"
      timeout 200 $N bench -m $m --backend gpu -p ${!pp:-128} -n 128 --reps 3 --ctx 1024 2>&1 | grep -E "^tg|^pp|^warm" | tee -a "$S"
    done
    IFS=';' read -ra QS <<< "${!sets-}"
    for fs in "${QS[@]}"; do
      say "$quant round $round: $file [$fs]"
      timeout 200 $N bench -m $file --backend gpu $fs -p ${!pp:-128} -n 128 --reps 3 --ctx 1024 2>&1 | grep -E "^tg|^pp|^warm" | tee -a "$S"
    done
  done
}
# Q8_0 (session 32, the byte form: the Q4_0 model's values, ~32 GB).
has q8 && gguf_quant_step q8_0 /tmp/q30-q8.gguf Q8
# Q6_K (session 33, the 6-bit form: random values quantised, ~25 GB).
has q6k && gguf_quant_step q6_k /tmp/q30-q6k.gguf Q6
# Q4_K with no mixture (session 33, the K form: random values quantised, ~19 GB).
has q4k && gguf_quant_step q4_k /tmp/q30-q4k.gguf Q4K
# llama.cpp's Q4_K_M mixture (session 34, per-tensor forms: Q4_K with Q6_K in the lm_head and in
# some layers' attn_v and ffn_down_exps; random values quantised, ~19 GB).
has q4km && gguf_quant_step q4_k_m /tmp/q30-q4km.gguf Q4KM
# llama.cpp's Q5_K_M mixture (session 34, the 5-bit K form with Q6_K; ~22 GB).
has q5km && gguf_quant_step q5_k_m /tmp/q30-q5km.gguf Q5KM
if has mlx8; then
  # MLX 8-bit checkpoints on the GPU (session 32, the 8-bit affine form): the full-size model
  # written here as mlx-lm's 8-bit groups of 64 (`synth --format mlx --quant q8_0`), open time
  # and peak memory, greedy parity against the oracle with the default prefills
  # (MLX8_PARITY_SETS: more flag sets), then tg128 and pp${MLX8_P:-512} (the GEMM prefill on
  # f32 fmas).
  M8=/tmp/q30-mlx8
  say "synth qwen3-30b-a3b --format mlx --quant q8_0"
  [ -s $M8/config.json ] || /usr/bin/time -f "synth mlx8 wall %e s, max RSS %M KB" $N synth --preset qwen3-30b-a3b --format mlx --quant q8_0 --seed 0 --tokenizer "$TOK" -o $M8 --quiet 2>&1 | tee -a "$S"
  du -sh $M8 | tee -a "$S"
  say "open + 1 token on the GPU: $M8"
  /usr/bin/time -f "wall %e s, max RSS %M KB" $N generate -m $M8 --backend gpu -n 1 -p Hi --ctx 512 -v 2>&1 | grep -E "wall|error|resident|prefill" | tee -a "$S"
  IFS=';' read -ra M8PS <<< "${MLX8_PARITY_SETS-}"
  for ps in "" "${M8PS[@]}"; do
    say "parity gpu vs oracle on the MLX 8-bit checkpoint [${ps:-default}] (3 built-in prompts x 32 tokens)"
    timeout ${MLX8_PT:-200} $N parity -m $M8 --backend gpu -n 32 --ctx 512 -v $ps 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
  done
  say "bench $M8"
  timeout 200 $N bench -m $M8 --backend gpu -p ${MLX8_P:-512} -n 128 --reps 3 --ctx 1024 2>&1 | grep -E "^tg|^pp|^warm" | tee -a "$S"
fi
if has cpu; then
  # The CPU backend on this machine's cores (no GPU involved), beside the oracle's step rate.
  say "bench cpu backend: tg32, pp256 ($(nproc) cores); parity cpu vs oracle"
  timeout 300 $N bench -m $MODEL --backend cpu -p 256 -n 32 --reps 3 --ctx 512 2>&1 | tee -a "$S"
  timeout 300 $N parity -m $MODEL --backend cpu -n 8 --ctx 512 2>&1 | tail -5 | tee -a "$S"
fi
if has batch; then
  say "bench gpu: tg128 single-stream and multi-stream batch 1/2/4/8"
  timeout 200 $N bench -m $MODEL --backend gpu -p 0 -n 128 --reps 3 --batch 1,2,4,8 --ctx 512 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
fi
if has load; then
  # The server's continuous batching on the GPU: 32 concurrent clients, a fixed request count,
  # half greedy / half sampled (seeded, top-k: sampled on the GPU in the same pipelined runs
  # since session 14; one-step runs before), then all greedy (pipelined folded runs).
  say "server load test: nibble serve --backend gpu --max-streams 8 --queue 64, 32 clients"
  $N serve -m $MODEL --backend gpu --max-streams 8 --queue 64 --ctx 2048 --port 8080 > "$OUT/serve.log" 2>&1 &
  SP=$!
  up() { python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=2)" 2>/dev/null; }
  for _ in $(seq 1 180); do up && break; sleep 1; done
  # LOAD_REQUESTS (default 288: about 60 s for the mixed run on the H200) requests of up to 64 tokens.
  LR="${LOAD_REQUESTS:-288}"
  for mode in mixed greedy; do
    say "load: $mode, $LR requests x up to 64 tokens"
    if [ $mode = greedy ]; then export NIBBLE_LOAD_GREEDY=1; fi
    NIBBLE_LOAD_URL=http://127.0.0.1:8080 NIBBLE_LOAD_REQUESTS=$LR NIBBLE_LOAD_MAX_TOKENS=64 \
      timeout 240 target/release/load-test --ignored --nocapture 2>&1 | grep -E "^load:|test result|panicked|assert" | tee -a "$S"
  done
  unset NIBBLE_LOAD_GREEDY
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8080/metrics').read().decode())" | grep '^nibble_' | tee -a "$S"
  kill $SP; wait $SP 2>/dev/null
  grep -v XDG_RUNTIME "$OUT/serve.log" | tail -5 | tee -a "$S"
fi
if has fold; then
  # The default N (--fold) is chosen from this sweep: tg128, 3 reps each, same model and process set-up.
  for f in 1 4 8 16 32 64; do
    say "bench gpu --fold $f: tg128"
    timeout 120 $N bench -m $MODEL --backend gpu --fold $f -p 0 -n 128 --reps 3 --ctx 256 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
  done
fi
if has numerics; then
  for num in precise-int8 int8; do
    say "bench gpu --numerics $num: tg128"
    timeout 150 $N bench -m $MODEL --backend gpu --numerics $num -p 0 -n 128 --reps 5 --ctx 256 -v 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
    say "parity --numerics $num (first prompt, 32 tokens)"
    echo "The capital of France is" > /tmp/p1.txt
    timeout 120 $N parity -m $MODEL --backend gpu --numerics $num --prompts /tmp/p1.txt -n 32 --ctx 256 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
  done
fi
if has numab; then
  # The default build at each numerics of NUMAB (default "f32 bfp24"): full parity for each, then
  # the bench (AB_ARGS, default tg128) in two interleaved rounds so drift hits all alike.
  for num in ${NUMAB:-f32 bfp24}; do
    say "parity --numerics $num (3 built-in prompts x 32 tokens)"
    timeout 300 $N parity -m $MODEL --backend gpu --numerics $num -n 32 --ctx 512 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
  done
  for round in 1 2; do
    for num in ${NUMAB:-f32 bfp24}; do
      say "numab round $round: --numerics $num"
      timeout 150 $N bench -m $MODEL --backend gpu --numerics $num ${AB_ARGS:--p 0 -n 128 --reps 3 --ctx 512} 2>&1 | grep -E "^tg|^pp" | tee -a "$S"
    done
  done
fi
if has depth16k; then
  say "bench gpu: tg128 at depth 16384"
  timeout 240 $N bench -m $MODEL --backend gpu -p 0 -n 128 --reps 3 --depth 16384 --ctx 16600 2>&1 | grep -v XDG_RUNTIME | tee -a "$S"
fi
say "done"
