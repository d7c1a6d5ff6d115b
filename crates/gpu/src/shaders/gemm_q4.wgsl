// Tiled int4 (or f32) x f32 GEMM of the batched prefill (gemm.rs): Y[row(m), n] (+)= W[n, :] .
// X[xrow(m), :] for a tile of BM token rows x 128 weight rows per workgroup. Prepended by the host:
// `TM` tokens per thread, `BM = 16 TM`, `XV` (TM floats: vec2<f32> or vec4<f32>), the form's tile
// functions (`gm_tile`, `gm_xrow`, `gm_yrow`), its weight staging (`WReg`, `gm_wfetch`: a
// thread's share of one block of 32 inputs into registers; `gm_wstore`: dequantised into `ws`),
// its epilogue lines (//GEMM_STORE), and the per-token accumulator lines (//GEMM_DECL, //GEMM_FMA).
//
// Forms (gemm.rs `GemmForm`): dense (tokens 0..dims.m of X and Y, weight rows of one matrix part,
// plain or `+=`; int4 or f32 weights: the router), gate_up (a MoE tile: the rows of one expert's assignment list, X gathered by
// token, gate rows in tile columns 0..64 and the same up rows in 64..128, `silu(gate) * up`
// stored) and down (a MoE tile, X and Y in list order).
//
// 256 threads = 16 x 16: thread (tx = li % 16, ty = li / 16) owns tokens ty*TM .. ty*TM+TM of the
// tile and weight columns tx*4 .. +4 and 64 + tx*4 .. +4 (so a warp's weight reads are 16
// consecutive vec4s: conflict-free, and its X reads are two broadcasts). The K dimension goes by
// one int4 block (32 values) per step: X [32][BM] and the dequantised W [32][128] are staged in
// shared memory; the next block's global loads are issued before the math of this one. Every
// accumulator is its own variable (//GEMM_DECL): the NVIDIA compiler puts per-thread arrays
// indexed in loops into slow local memory.
//
// Per (token, weight row) the sum runs over k in order (over the split's k with K in splits),
// one f32 fma each, on exactly dequantised weights (f16 scale x (nibble - 8) is exact in f32):
// the oracle's products up to f32 rounding.
// Params, Dims, bindings 2..5 and Tile: gemm_common.wgsl (shared with gemm_coop.rs).

// X of the block: xs[k * BM / TM + i] holds tokens TM i .. TM i + TM at k.
var<workgroup> xs: array<XV, 32u * BM / TM>;
// Dequantised W of the block: ws[k * 32 + c] holds tile columns 4c .. 4c + 4 at k.
var<workgroup> ws: array<vec4<f32>, 32u * 32u>;

fn silu(g: f32) -> f32 {
    return g / (1.0 + exp(-g));
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    // Uniform per workgroup, so no barrier below is skipped by part of it.
    let t = gm_tile(wid);
    if (!t.ok) {
        return;
    }
    let tx = li % 16u;
    let ty = li / 16u;
    // Staging roles. X: row sr of the tile, vec4s sv .. sv + XPT of the block (32 bytes or 16
    // contiguous per thread; a warp's stores are 32 consecutive rows: conflict-free).
    let sr = li % BM;
    let sv = (li / BM) * XPT;
    let xrow = gm_xrow(t, min(t.m0 + sr, t.mend - 1u));
    // W: tile column nn, half h of the block's share (see `gm_wfetch`).
    let nn = li % 128u;
    let h = li / 128u;
    // The blocks [kb, kend) of this workgroup's K split (grid z; one split of bpr blocks unless
    // the binding splits K: its partial sums go to their own rows of Y, see `gm_tile`).
    let kb = min(min(wid.z, p.splits - 1u) * p.ks, p.bpr - 1u);
    let kend = min(kb + p.ks, p.bpr);
    var xr: array<vec4<f32>, XPT>;
    //GEMM_DECL
    for (var i = 0u; i < XPT; i++) {
        xr[i] = x[xrow * p.xs4 + kb * 8u + sv + i];
    }
    var wr = gm_wfetch(wid, t, nn, h, kb);
    for (var b = kb; b < kend; b++) {
        // The previous block's math is done with the staging buffers.
        workgroupBarrier();
        for (var i = 0u; i < XPT; i++) {
            let k = 4u * (sv + i);
            let v = xr[i];
            xs[(k * BM + sr) / TM][sr % TM] = v.x;
            xs[((k + 1u) * BM + sr) / TM][sr % TM] = v.y;
            xs[((k + 2u) * BM + sr) / TM][sr % TM] = v.z;
            xs[((k + 3u) * BM + sr) / TM][sr % TM] = v.w;
        }
        gm_wstore(wr, nn, h);
        workgroupBarrier();
        // The next block's loads overlap this block's math.
        if (b + 1u < kend) {
            for (var i = 0u; i < XPT; i++) {
                xr[i] = x[xrow * p.xs4 + (b + 1u) * 8u + sv + i];
            }
            wr = gm_wfetch(wid, t, nn, h, b + 1u);
        }
        for (var k = 0u; k < 32u; k++) {
            let xv = xs[k * (BM / TM) + ty];
            let w0 = ws[k * 32u + tx];
            let w1 = ws[k * 32u + 16u + tx];
            //GEMM_FMA
        }
    }
    //GEMM_STORE
}
