//! L2 warming: extra workgroups appended to one dispatch that read the weights a LATER dispatch
//! of the step will read, so that dispatch finds them in the GPU's L2 cache instead of memory.
//!
//! Why: a decode step streams the whole model once per token, so every kernel's weights are
//! cold, and the dense kernels move only 5-12 MB each: their time is latency, not bandwidth
//! (docs/BENCHMARKS.md run 17: with L2-resident weights the qkv takes 9.1 us instead of 10.1,
//! the o-proj 7.4 instead of 8.4). The memory bus sits mostly idle meanwhile, so a kernel
//! that runs anyway can pull the next kernel's bytes in. It must be the SAME dispatch: wgpu
//! puts a pipeline barrier before every dependent dispatch, and a Vulkan barrier waits for all
//! earlier work, so a separate warming dispatch would finish before the next kernel starts and
//! overlap nothing.
//!
//! What a warm workgroup does (`WARM_WGSL`, `warm(i, li)`): it loads one 32-bit word of each
//! 32-byte sector (the unit L2 fills from memory) of its share of the matrix's nibble blocks,
//! then of its scales, [`LOADS`] loads per thread issued together, xors them, and stores the
//! result into a sink buffer only if it equals a constant: a data-dependent store that nothing
//! reads, so the compiler cannot drop the loads, and results are untouched whatever the data.
//! The warm workgroups come after the kernel's own (higher workgroup ids, dispatched last), so
//! they do not delay its first loads.

use crate::context::{Context, Result};
use crate::tensor::Q4Part;

/// Sector loads per thread of a warm workgroup (issued together, then xored).
pub const LOADS: u32 = 8;
/// Threads of a warm workgroup (the workgroup size of every kernel that hosts them).
const THREADS: u32 = 256;
/// Bytes per L2 sector: one load per sector fills the whole sector.
const SECTOR: u64 = 32;

/// WGSL of the warm workgroups, with its three bindings at `@binding(WARM_Q)`, `(WARM_S)`,
/// `(WARM_SINK)`: the host replaces those names by free binding numbers of the including
/// shader ([`wgsl`]). `warm(i, li)`: warm workgroup `i` (0-based among the dispatch's warm
/// workgroups), thread `li` of 256. Uniform per workgroup, no barriers.
const WARM_WGSL: &str = "
@group(0) @binding(WARM_Q) var<storage, read> warm_q: array<u32>;          // the part's nibble blocks
@group(0) @binding(WARM_S) var<storage, read> warm_s: array<u32>;          // its f16 scale pairs
@group(0) @binding(WARM_SINK) var<storage, read_write> warm_sink: array<u32>; // [1], never read
const WARM_LOADS: u32 = 8u;
fn warm(i: u32, li: u32) {
    let sq = (arrayLength(&warm_q) + 7u) / 8u;
    let ss = (arrayLength(&warm_s) + 7u) / 8u;
    var t = 0u;
    for (var k = 0u; k < WARM_LOADS; k++) {
        let s = (i * WARM_LOADS + k) * 256u + li;
        if (s < sq) {
            t ^= warm_q[8u * s];
        } else if (s - sq < ss) {
            t ^= warm_s[8u * (s - sq)];
        }
    }
    // Depends on every load, so none is dead code; nothing ever reads the sink.
    if (t == 0x2545f491u) {
        warm_sink[0] = t;
    }
}
";

/// `WARM_WGSL` with its bindings at `q`, `s` and `sink`.
pub fn wgsl(q: u32, s: u32, sink: u32) -> String {
    WARM_WGSL
        .replace("WARM_SINK", &sink.to_string())
        .replace("WARM_Q", &q.to_string())
        .replace("WARM_S", &s.to_string())
}

/// Warm workgroups that cover `part` (every sector of its blocks and scales).
pub fn workgroups(part: &Q4Part) -> u32 {
    let sectors = part.qs.size().div_ceil(SECTOR) + part.scales.size().div_ceil(SECTOR);
    sectors.div_ceil((LOADS * THREADS) as u64) as u32
}

/// The sink every warm workgroup may store into (4 bytes, never read).
pub fn sink(ctx: &Context) -> Result<wgpu::Buffer> {
    ctx.storage("warm.sink", 16)
}

/// The bind group entries of the warm bindings at `(q, s, sink)` for `part`.
pub fn entries<'a>(
    part: &'a Q4Part,
    sink_buf: &'a wgpu::Buffer,
    at: (u32, u32, u32),
) -> [(u32, wgpu::BindingResource<'a>); 3] {
    [
        (at.0, part.qs.as_entire_binding()),
        (at.1, part.scales.as_entire_binding()),
        (at.2, sink_buf.as_entire_binding()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wgsl_names_its_bindings() {
        let w = wgsl(7, 8, 9);
        assert!(w.contains("@binding(7) var<storage, read> warm_q"));
        assert!(w.contains("@binding(8) var<storage, read> warm_s"));
        assert!(w.contains("@binding(9) var<storage, read_write> warm_sink"));
        assert!(!w.contains("WARM_Q") && !w.contains("WARM_SINK"));
        assert!(w.contains(&format!("WARM_LOADS: u32 = {LOADS}u")));
    }
}
