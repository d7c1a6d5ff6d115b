// The rows of one part of matvec_q4f.wgsl in one block form (`QB`, `SW` and their functions,
// prepended by the host; matvec_wgsl.rs `q4f_rows`): `mv_rows(wg, li, rows, row_start)` is
// workgroup `wg`'s share of a part of `rows` rows stored from `y[row_start]` on. A dispatch over
// a stack of two forms (a `Q4_K_M` qkv: q and k Q4_K, v Q6_K) holds two copies, the second with
// every name of its form and of this file suffixed (matvec_wgsl.rs `q4f_pair_body`), so its
// workgroups read the other part in the other form.
@group(0) @binding(QS_BINDING) var<storage, read> qs: array<QB>;   // [rows * bpr] blocks (tensor.rs QForm)
@group(0) @binding(SC_BINDING) var<storage, read> sc: array<SW>;   // [rows * bpr / 2] scale words (tensor.rs QForm)

fn scale(i: u32) -> f32 {
    return q4_coef(sc[i >> 1u], i).x;
}

fn mv_rows(wg: u32, li: u32, rows: u32, row_start: u32) {
    let team = li / T;
    let lane = li % T;
    let row0 = wg * (NT * R) + team * R;
    // ROWS_PREFETCH, ROWS_DECL, ROWS_FIRST, ROWS_BODY, ROWS_STORE: expanded by the host once
    // per row of the team (acc0, acc1, ..): separate variables, since a per-thread array indexed
    // in a loop may be placed in slow local memory by the driver's compiler. Rows past the end
    // read row 0 (always there) and are never written.
    // The lane's first block of each row is loaded before the staging, so those loads are in
    // flight while the workgroup stages (and normalises) the input instead of after it.
    let b0 = min(lane, p.bpr - 1u);
    //ROWS_PREFETCH
    nol_stage(li, p.bpr * 8u, p.eps);
    //ROWS_DECL
    if (lane < p.bpr) {
        let x = xblock(lane);
        //ROWS_FIRST
    }
    for (var b = lane + T; b < p.bpr; b += T) {
        let x = xblock(b);
        //ROWS_BODY
    }
    //ROWS_STORE
    workgroupBarrier();
    // A thread per row of the workgroup's NT R; at 2 lanes and 4 rows per team (512 rows) a
    // thread takes two, 256 apart.
    for (var k = li; k < NT * R; k += 256u) {
        var s = 0.0;
        for (var j = 0u; j < T; j++) {
            s += red[k * TP + j];
        }
        // 1.0 (exact) except in the late-norm form, where it is the RMSNorm's scale.
        s *= nol_scale(p.eps, p.bpr * 8u);
        let row = wg * (NT * R) + k;
        if (row < rows) {
            if (ACC) {
                y[row_start + row] += s;
            } else {
                y[row_start + row] = s;
            }
        }
    }
}
